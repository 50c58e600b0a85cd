"""The GPT-2 BPE tokenizer (50,257 ids), built offline from the ranks file in the package.

tiktoken's ``get_encoding("gpt2")`` downloads the merge ranks at run time and fails with no
network. The package ships them (``moremoe/assets/gpt2.tiktoken``, the same bytes as
tiktoken's ``r50k_base``); the encoding is built from that file (or one given by path) after
checking its sha256, with GPT-2's pre-tokenizer pattern and ``<|endoftext|>`` = 50256.

The file is parsed here rather than by ``tiktoken.load.load_tiktoken_bpe``: that function
re-reads the path and keeps a copy in a cache folder under /tmp, while here the bytes whose
hash was checked are the bytes that are parsed. The format is the same (one
``base64(token) rank`` per line).
"""
from __future__ import annotations

import base64
import hashlib
from functools import lru_cache
from pathlib import Path

NAME = "gpt2"
VOCAB_SIZE = 50257
EOT_ID = 50256
EOT = "<|endoftext|>"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenizer as published; tiktoken_ext.openai_public.r50k_pat_str (0.8+) writes the
# same splits with possessive quantifiers, which older tiktoken cannot parse
R50K_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def default_ranks_path() -> Path:
    """The ranks file shipped with the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "gpt2.tiktoken"


def gpt2_encoding(ranks_path: str | Path | None = None):
    """The GPT-2 ``tiktoken.Encoding`` (cached per path); raises ValueError if the ranks file is
    missing or its sha256 is not GPT-2's."""
    path = Path(ranks_path) if ranks_path is not None else default_ranks_path()
    return _encoding(str(path.expanduser().resolve()))


@lru_cache(maxsize=4)
def _encoding(path: str):
    try:
        import tiktoken
    except ImportError:
        raise ImportError("the GPT-2 tokenizer needs tiktoken: pip install 'moremoe[text]'") \
            from None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read the GPT-2 ranks file {path} (--tokenizer-ranks): "
                         f"{err.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise ValueError(f"the GPT-2 ranks file {path} has sha256 {digest}, expected "
                         f"{RANKS_SHA256} (tiktoken's r50k_base / gpt2.tiktoken): it is "
                         f"truncated, corrupt or a different vocabulary")
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(NAME, pat_str=R50K_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: EOT_ID}, explicit_n_vocab=VOCAB_SIZE)
