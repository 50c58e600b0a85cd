"""What a text can fill, checked for `moremoe data prepare` and `data mixture`: a GPT-2 token
is one byte of UTF-8 text or more, so the bytes of .txt and .jsonl inputs bound the
sequences they can give before any is tokenised, and the tokens bound them after; the
messages name the sizes that would fit."""
from __future__ import annotations

from pathlib import Path


def check_held_out(n_train: int, n_val: int, v: int, T: int, partial: Path) -> None:
    kept = f"(the tokenised text stays in {partial}: the next run reuses it)"
    if n_train < 1:
        raise ValueError(f"too few sequences: the training inputs give no sequence of "
                         f"--seq-len {T}; give more text or a shorter --seq-len {kept}")
    if v > n_val or n_val == 0:
        raise ValueError(f"too few validation sequences: the --val-input texts give {n_val:,} "
                         f"sequences of --seq-len {T} and --val-sequences asks for {v:,}; "
                         f"leave --val-sequences out (all of them) or give at most {n_val:,} "
                         f"{kept}")


def check_enough_text(config, sources, val_sources) -> None:
    """Refuse, before any work, a --seq-len and --val-sequences that the inputs cannot fill
    at any tokenisation: a GPT-2 token is one byte of UTF-8 text or more, and a document adds
    one end-of-text, so .txt files give at most their bytes + 1 tokens each and .jsonl files
    (quotes and keys around the text) at most their bytes. The sizes of .jsonl.gz files and
    saved datasets say nothing of their text: those are checked once tokenised."""
    if any(s.kind not in ("txt", "jsonl") for s in sources + val_sources):
        return
    nbytes = sum(s.size for s in sources)
    if nbytes == 0:
        raise ValueError(no_text(sources, config.text_field))
    bound = token_bound(sources)
    T, v = config.seq_len, config.val_sequences
    if val_sources:
        val_bound = token_bound(val_sources)
        if bound // T < 1:
            raise ValueError(f"too few sequences: the training INPUTs hold at most {bound:,} "
                             f"tokens, not one sequence of --seq-len {T}; give more text or a "
                             f"shorter --seq-len")
        if val_bound // T < (v or 1):
            raise ValueError(f"too few validation sequences: the --val-input texts hold at "
                             f"most {val_bound:,} tokens = {val_bound // T:,} sequences of "
                             f"--seq-len {T}, and {v or 1:,} are asked for; give more text, a "
                             f"shorter --seq-len or fewer --val-sequences")
    elif bound // T <= v:
        raise ValueError(f"too few sequences: the inputs hold {nbytes:,} bytes of text, at "
                         f"most {bound:,} tokens = {bound // T:,} sequences of --seq-len {T}, "
                         f"and --val-sequences {v:,} leaves none for training; "
                         f"{seq_len_fixes([bound], T, v, upper=True)}")


def token_bound(sources) -> int:
    return sum(s.size for s in sources) + sum(s.kind == "txt" and s.size > 0 for s in sources)


def longest_seq_len(taken: list[int], need: int) -> int:
    """The longest sequence length at which sources of `taken` tokens give `need` sequences
    in all (0 when even length 1 gives fewer); one source: taken[0] // need."""
    lo, hi = 0, max(taken, default=0)
    while lo < hi:                      # sum(t // T) falls as T grows
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(t // mid for t in taken) >= need else (lo, mid - 1)
    return lo


def seq_len_fixes(taken: list[int], T: int, v: int, *, more: str = "more text",
                  upper: bool = False) -> str:
    """What leaves sources of `taken` tokens (upper: at most) a training sequence beside
    the --val-sequences v: (v + 1) sequences of --seq-len T must fit, each within a
    source."""
    fixes = []
    longest = longest_seq_len(taken, v + 1)
    if longest >= 2:
        fixes.append(f"a --seq-len of at most {longest:,}")
    n_seq = sum(t // T for t in taken)
    if n_seq >= 1:
        fixes.append(f"--val-sequences of at most {n_seq - 1:,}")
    if not fixes and (pair := longest_seq_len(taken, 2)) >= 2:
        fixes.append(f"--val-sequences 1 with a --seq-len of at most {pair:,}")
    if not fixes:
        return f"give {more}"
    return (f"use {' or '.join(fixes)}"
            + (" (upper limits: a token is usually several bytes)" if upper else "")
            + f", or {more}")


def no_text(sources, text_field: str) -> str:
    empty = [s.path for s in sources if s.size == 0]
    if len(sources) == 1:
        what = "is empty" if empty else f"holds no text (no document with text in " \
                                        f"{text_field!r})"
        return f"the input {sources[0].path} {what}; give a file with text"
    some = f" ({len(empty):,} empty, e.g. {empty[0]})" if empty else ""
    return (f"the {len(sources):,} input files{some} hold no text (no document with text in "
            f"{text_field!r}); check the INPUT arguments")
