"""The ``moremoe`` command (the entry point and ``python -m moremoe.cli``)."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
