"""Parallelism applied from outside the single-device model: DDP and FSDP2 wiring, and
expert parallelism for one MoE layer (expert.py, sharded_router.py, collectives.py)."""
