"""Argument types shared by the command-line modules: errors name the value and what was
expected (argparse adds the flag). Numbers must be finite; integers must be written as
integers, read exactly (1e4 is 10000, 1e30 is 10^30, 1.5 is an error, never truncated or
rounded through a float). A comma list names a value it repeats."""
from __future__ import annotations

import argparse
import decimal
import math

EPILOG = "Letters: M experts, k active experts, h hidden, s expert width, r router rank."


def _int_at_least(low: int):
    def parse(text: str) -> int:
        v = _integer(text)
        if v is None:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v
    return parse


SEED_MAX = 2 ** 63 - 2      # torch's generators take 64-bit seeds; + 1 for a second stream


def _seed(text: str) -> int:
    v = _int_at_least(0)(text)
    if v > SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {SEED_MAX}], got {text!r}")
    return v


def _positive_int(text: str) -> int:
    v = _integer(text)
    if v is None or v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


MAX_DIGITS = 4300      # Python's own limit on the digits of an int read from text


def _integer(text: str) -> int | None:
    """int(text), also for 1e4, 1.5e3 or 10000.0, exactly (decimal, never a float: 1e30 is
    10^30); None when it is not a whole finite number. Beyond MAX_DIGITS digits (1e999999999
    would take minutes and gigabytes to build) an error that says so."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        d = decimal.Decimal(text.strip())
    except (decimal.InvalidOperation, ValueError):
        return None
    if not d.is_finite() or d != d.to_integral_value():
        return None
    if d and d.adjusted() >= MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"expected an integer of at most {MAX_DIGITS:,} "
                                         f"digits, got {text!r}")
    return int(d)


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    v = _finite(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _fraction(text: str) -> float:
    """A share in (0, 1], such as an exact-match threshold: 0 would call any run a success."""
    v = _finite(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


def _open_fraction(text: str) -> float:
    """A share strictly between 0 and 1, such as the part of a corpus held out."""
    v = _finite(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return v


def _unit_or_zero(text: str) -> float:
    """A threshold in (0, 1], or 0 for off."""
    v = _finite(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] (0: off), got {text!r}")
    return v


def _int_list(text: str) -> list[int]:
    values = [_integer(t) for t in text.replace(" ", "").split(",") if t]
    if not values or None in values:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1000,3000,10000, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return _distinct(values, text)


def _float_list(text: str) -> list[float]:
    parts = [t for t in text.split(",") if t.strip()]
    try:
        values = [_positive_float(t) for t in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive finite numbers, "
                                         f"got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return _distinct(values, text)


def _distinct(values: list, text: str) -> list:
    """The values of a comma list, refused when one repeats (1e3 and 1000 are one value): a
    list is a set of runs or rows, and a repeat would run twice, print twice, or be
    recorded twice and run once."""
    seen = set()
    for v in values:
        if v in seen:
            times, shown = values.count(v), f"{v:g}" if isinstance(v, float) else v
            raise argparse.ArgumentTypeError(
                f"{text!r} lists {shown} {'twice' if times == 2 else f'{times} times'}; give "
                f"each value once")
        seen.add(v)
    return values


def _add_json(p) -> None:
    p.add_argument("--json", action="store_true",
                   help="print strict JSON (for scripts; NaN and infinity become null) "
                        "instead of a table")


def _path(text: str) -> str:
    """A file or folder name, never empty: pathlib reads "" as the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty path, got {text!r}")
    return text
