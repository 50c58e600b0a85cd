"""The ``moremoe`` command line: the parser and the one place errors become output.

Every command prints a readable table by default and strict JSON with ``--json``; long work
shows a progress bar on stderr. One module per command group (plan, phonebook, bench, data,
train, study, eval, generate, hf, demo) adds its parser; ``main`` runs the command and turns an
error the user can act on into one line (exit status 2), anything else into one line that
says it is a bug (exit status 1); ``--debug`` or MOREMOE_DEBUG=1 shows the traceback
instead. Running out of memory is the sizing asked for, not a bug: one line, exit status 2.
Under torchrun only rank 0 prints an error line.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..checks import RankError, UserError
from ..runtime import __version__
from .args import EPILOG
from .bench import add_bench_parser
from .convert import add_convert_parser
from .data import add_data_parser
from .demo import add_demo_parser
from .eval import add_eval_parser
from .generate import add_generate_parser
from .hf import add_hf_parser
from .memory import out_of_memory
from .phonebook import add_phonebook_parser
from .plan import add_plan_parsers
from .study import add_study_parser
from .theory import add_theory_parser
from .train import add_plot_parser, add_train_parser


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors in one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="moremoe", epilog=EPILOG,
        description="MoRE: Mixture of Rank-reduced-routed Experts. Accounting, planning and "
                    "experiments for MoE layers with a low-rank router R1 (M×r) · R2 (r×h).")
    parser.add_argument("--version", action="version", version=f"moremoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (add_plan_parsers, add_phonebook_parser, add_bench_parser, add_data_parser,
                add_train_parser, add_eval_parser, add_generate_parser, add_hf_parser,
                add_demo_parser, add_theory_parser, add_convert_parser, add_plot_parser,
                add_study_parser):
        add(sub)
    return parser


# Errors a user can act on: printed as one line, exit status 2. Anything else is a bug:
# one line that says so, exit status 1. --debug or MOREMOE_DEBUG=1 shows the traceback.
EXPECTED = (UserError, ValueError, TypeError, LookupError, OSError, ImportError)


def _leaves(parser: argparse.ArgumentParser):
    """Every parser that runs a command (the ones without subcommands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in action.choices.values():
            yield from _leaves(child)


def _with_debug(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for leaf in _leaves(parser):
        leaf.add_argument("--debug", action="store_true",
                          help="show the traceback of an error (also MOREMOE_DEBUG=1)")
        leaf.set_defaults(prog=leaf.prog)
    return parser


def one_line(err: BaseException) -> str:
    """The message of an error as one line (KeyError's without its quotes)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    text = " ".join(str(text).split())
    return text or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    args = _with_debug(build_parser()).parse_args(argv)
    debug = args.debug or os.environ.get("MOREMOE_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{args.prog}: interrupted; reports written so far are kept", file=sys.stderr)
        return 130
    except EXPECTED as err:
        if debug:
            raise
        _say(f"{args.prog}: error: {one_line(err)}", every_rank=isinstance(err, RankError))
        return 2
    except Exception as err:      # noqa: BLE001 - a bug: say so in one line, not a traceback
        if debug:
            raise
        ran_out = out_of_memory(err)
        if ran_out is not None:       # the sizes given, not a bug (commands say which ones)
            _say(f"{args.prog}: error: {ran_out}: what was asked for does not fit; use "
                 f"smaller sizes or a larger device (see {args.prog} --help)")
            return 2
        print(f"{args.prog}: error: internal error ({type(err).__name__}: {one_line(err)}); "
              f"run it again with --debug for the traceback and report it", file=sys.stderr)
        return 1


def _say(line: str, every_rank: bool = False) -> None:
    """An error the user can act on, on stderr; under torchrun only rank 0 says it (every
    rank meets the same one, and torchrun names a rank that failed alone) unless it is one
    rank's own (every_rank: checks.RankError). A process whose RANK and WORLD_SIZE are not
    a valid launch says it too: it may be no rank at all."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        rank, world = 0, 1
    if every_rank or not 0 < rank < world:
        print(line, file=sys.stderr)

