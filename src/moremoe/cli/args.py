"""Argument types shared by the command-line modules: errors name the value and what was
expected. Numbers must be finite; integers must be written as integers (1e4 is 10000, 1.5
is an error, never truncated)."""
from __future__ import annotations

import argparse
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


def _integer(text: str) -> int | None:
    """int(text), also for 1e4 or 10000.0; None when it is not a whole finite number."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


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


def _int_list(text: str) -> list[int]:
    values = [_integer(t) for t in text.replace(" ", "").split(",") if t]
    if not values or None in values:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1000,3000,10000, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    parts = [t for t in text.split(",") if t.strip()]
    try:
        values = [_positive_float(t) for t in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive finite numbers, "
                                         f"got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _add_json(p) -> None:
    p.add_argument("--json", action="store_true",
                   help="print strict JSON (for scripts; NaN and infinity become null) "
                        "instead of a table")
