"""Parallelism applied from outside the single-device model: DDP wiring."""
