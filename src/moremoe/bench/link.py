"""The link between the ranks of one machine, measured in the run that moves the layers'
rows over it (``bench ep``, issue 37): the ceiling the exchange is judged against. For B
bytes a rank sends to each other rank:

  peer copy    one process copies B bytes from its GPU to the next one's (torch's
               cross-device copy: cudaMemcpyPeer over NVLink where the GPUs have it),
               rank 0 alone while the others wait; what the link carries with no library
               in the way (None when rank 0 sees one GPU, or on a CPU)
  send/recv    NCCL (gloo on a CPU) between the rank pairs (0, 1), (2, 3), ..., both
               directions at once: the library's point-to-point rate
  all-to-all   all_to_all_single with B bytes to each other rank and none to itself: what
               (b)'s exchange is, one round, perfectly balanced

Each is timed with harness.time_fixed_ms (device events, median after warm-up, the same
calls on every rank) and reported in GB/s a direction: the bytes one rank sends over the
median time. Every rank returns rank 0's figures.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .harness import time_fixed_ms


def _gbps(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else nbytes / (ms / 1e3) / 1e9


def _peer_copy_ms(nbytes: int, device, *, warmup: int, reps: int) -> float | None:
    """Rank 0 copying nbytes from its GPU to the next visible one; None without two."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=other)
    # the copy runs on the source device's current stream (ATen syncs both), which the
    # events bracket
    ms = time_fixed_ms(lambda: dst.copy_(src, non_blocking=True), device=device,
                       warmup=warmup, reps=reps)
    del src, dst
    return ms


def link_rates(device, nbytes: int, *, warmup: int = 3, reps: int = 10) -> dict:
    """{"link_bytes", "link_peer_copy_gbps", "link_send_recv_gbps", "link_all_to_all_gbps"}
    (GB/s a direction) for nbytes a rank sends each other rank; call on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = [device.index] if device.type == "cuda" else None
    peer = None
    if rank == 0:
        peer = _peer_copy_ms(nbytes, device, warmup=warmup, reps=reps)
    dist.barrier(device_ids=ids)

    partner = rank ^ 1
    send = torch.empty(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def send_recv():
        if partner >= world:       # the odd rank out times nothing
            return
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner),
                                            dist.P2POp(dist.irecv, recv, partner)]):
            work.wait()

    pair_ms = time_fixed_ms(send_recv, device=device, warmup=warmup, reps=reps)
    dist.barrier(device_ids=ids)
    del send, recv

    splits = [0 if r == rank else nbytes for r in range(world)]
    out_ = torch.empty(nbytes * (world - 1), dtype=torch.uint8, device=device)
    in_ = torch.empty_like(out_)
    a2a_ms = time_fixed_ms(lambda: dist.all_to_all_single(in_, out_, splits, splits),
                           device=device, warmup=warmup, reps=reps)
    del out_, in_
    box = [{"link_bytes": nbytes,
            "link_peer_copy_gbps": _gbps(nbytes, peer),
            "link_send_recv_gbps": _gbps(nbytes, pair_ms) if world > 1 else None,
            "link_all_to_all_gbps": _gbps(nbytes * (world - 1), a2a_ms)}]
    dist.broadcast_object_list(box, src=0)
    return box[0]
