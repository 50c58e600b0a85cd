"""GPT-2's tokenizer as transformers files (tokenizer.json, tokenizer_config.json), built
offline from the ranks file the package ships (tasks/tokenizer.py), so that
``PreTrainedTokenizerFast.from_pretrained(export)`` (and, after moremoe.hf.register(),
``AutoTokenizer`` and ``pipeline("text-generation", model=export)``) read text exactly as
moremoe's data was tokenized.

A tiktoken ranks file is a byte-level BPE given by its vocabulary alone: a token of rank r is
made by the merge of the two pieces that BPE over its own bytes, using only the ranks below
r, leaves (the recovery transformers' tiktoken converter does too). The vocabulary and the
merges are written in GPT-2's byte-to-unicode alphabet, with GPT-2's byte-level
pre-tokenizer (the same split pattern as tasks/tokenizer.R50K_PATTERN) and <|endoftext|>
as the special, beginning, end and unknown token.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from ..tasks.tokenizer import EOT, EOT_ID, VOCAB_SIZE, gpt2_encoding

FILES = ("tokenizer.json", "tokenizer_config.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of vocab.json and merges)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def _pieces(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """BPE of token's bytes with the merges of rank < below: the lowest-ranked adjacent pair
    first, until none is left."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < below and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


@lru_cache(maxsize=1)
def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocabulary (50,257 entries) and its 50,000 merges, in rank order."""
    ranks = gpt2_encoding()._mergeable_ranks
    alphabet = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(alphabet[c] for c in b)

    vocab, merges = {text(t): r for t, r in ranks.items()}, []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _pieces(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"the GPT-2 ranks do not make token {rank} from one merge")
        merges.append((text(parts[0]), text(parts[1])))
    vocab[EOT] = EOT_ID
    return vocab, merges


def gpt2_tokenizer():
    """A transformers PreTrainedTokenizerFast of GPT-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab, merges = vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                   unk_token=EOT, model_max_length=None)
    if len(fast) != VOCAB_SIZE:
        raise ValueError(f"the GPT-2 tokenizer has {len(fast)} ids, expected {VOCAB_SIZE}")
    return fast


def write_gpt2_tokenizer(out_dir: str | Path, max_length: int) -> list[str]:
    """tokenizer.json and tokenizer_config.json (and what else the installed transformers
    writes beside them) in out_dir; max_length: the model's max_seq_len. Returns the names
    written."""
    tok = gpt2_tokenizer()
    tok.model_max_length = max_length
    names = sorted(Path(p).name for p in tok.save_pretrained(str(out_dir)))
    # the class name of transformers 4 and 5 alike (5 writes its own, TokenizersBackend)
    config = Path(out_dir) / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return names
