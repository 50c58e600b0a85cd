"""Benchmarks: one timing harness (``timing``) and one small module per benchmark."""
