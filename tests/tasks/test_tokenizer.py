"""The offline GPT-2 tokenizer: known ids, the vocabulary, and the ranks file check."""
import pytest

from moremoe.tasks import tokenizer
from moremoe.tasks.tokenizer import EOT_ID, VOCAB_SIZE, default_ranks_path, gpt2_encoding

tiktoken = pytest.importorskip("tiktoken")


@pytest.mark.parametrize("text, ids", [
    ("Hello world", [15496, 995]),
    ("The quick brown fox", [464, 2068, 7586, 21831]),
    (" I'm here", [314, 1101, 994]),
    ("<|endoftext|>", [27, 91, 437, 1659, 5239, 91, 29]),    # ordinary text, not the special id
])
def test_known_gpt2_ids(text, ids):
    enc = gpt2_encoding()
    assert enc.encode_ordinary(text) == ids
    assert enc.decode(ids) == text


def test_vocabulary_and_end_of_text():
    enc = gpt2_encoding()
    assert enc.n_vocab == VOCAB_SIZE == 50257
    assert enc.eot_token == EOT_ID == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_ID]
    assert gpt2_encoding(str(default_ranks_path())) is enc      # cached per resolved path


def test_pattern_splits_like_tiktokens_r50k():
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    enc = gpt2_encoding()
    theirs = tiktoken.Encoding("r50k", pat_str=openai_public.r50k_pat_str,
                               mergeable_ranks=enc._mergeable_ranks,
                               special_tokens={"<|endoftext|>": EOT_ID})
    text = ("x \n\n  y\t\tz  \n it's we'll they've I'd 12345 3.14 ünïcödé 日本語 "
            "emoji 🙂🙂  trailing   \n\n")
    assert enc.encode_ordinary(text) == theirs.encode_ordinary(text)


def test_wrong_or_missing_ranks_file_is_rejected(tmp_path):
    lines = default_ranks_path().read_bytes().splitlines(keepends=True)
    truncated = tmp_path / "truncated.tiktoken"
    truncated.write_bytes(b"".join(lines[:-1]))
    with pytest.raises(ValueError, match=rf"{truncated}.*sha256 [0-9a-f]{{64}}, expected "
                                         rf"{tokenizer.RANKS_SHA256}"):
        gpt2_encoding(truncated)
    with pytest.raises(ValueError, match="cannot read the GPT-2 ranks file .*--tokenizer-ranks"):
        gpt2_encoding(tmp_path / "absent.tiktoken")
    good = tmp_path / "copy.tiktoken"
    good.write_bytes(b"".join(lines))
    assert gpt2_encoding(good).encode_ordinary("Hello world") == [15496, 995]
