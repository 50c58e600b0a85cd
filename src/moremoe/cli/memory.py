"""Running out of memory is the user's sizing, not a bug: a command turns it into one line that
says what did not fit and which of its options make it fit (``advise_on_memory``); main's
handler does the same, with a generic hint, for a command that does not."""
from __future__ import annotations

import contextlib
import re

from ..checks import UserError

_SIZE = r"([\d.]+ [KMGT]?i?B)"


def out_of_memory(err: BaseException) -> str | None:
    """What ran out, when err is running out of memory: torch.OutOfMemoryError (a GPU), the
    CPU allocator's RuntimeError, or Python's MemoryError; else None."""
    text = " ".join(str(err).split())
    if any(c.__name__ == "OutOfMemoryError" for c in type(err).__mro__):
        asked = re.search(rf"[Tt]ried to allocate {_SIZE}", text)
        gpu = re.search(rf"GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE} is free",
                        text)
        where = f"GPU {gpu.group(1)}" if gpu else "the GPU"
        detail = [f"{asked.group(1)} more asked for"] if asked else []
        if gpu:
            detail.append(f"{gpu.group(3)} free of {gpu.group(2)}")
        return f"{where} ran out of memory" + (f" ({', '.join(detail)})" if detail else "")
    if isinstance(err, MemoryError) or "can't allocate memory" in text:
        asked = re.search(r"allocate (\d+) bytes", text)
        more = f" ({int(asked.group(1)) / 2**30:,.1f} GiB more asked for)" if asked else ""
        return f"the machine ran out of memory{more}"
    return None


@contextlib.contextmanager
def advise_on_memory(what: str, change: str):
    """Running out of memory inside the block becomes a UserError: '<what ran out>: <what>
    does not fit; <change>'."""
    try:
        yield
    except Exception as err:           # noqa: BLE001 - re-raised unless it is memory
        ran_out = out_of_memory(err)
        if ran_out is None:
            raise
        raise UserError(f"{ran_out}: {what} does not fit; {change}") from err
