"""Benchmarks: one timing harness (``harness``) and one small module per benchmark."""
