"""The router selection kernels compiled for an H100/H200 (sm_90) on a machine without a GPU,
their loops counted instruction by instruction: a prediction to write before a device run.

    python benchmarks/router_sass.py                 # k = 4, h = 512 tiles (BN 64, BM 128, r 64)
    python benchmarks/router_sass.py --k 8 --anchors ../shared/anchors

Triton compiles each kernel as its JIT would for bf16 inputs of the bench's shape (the unit
strides and the 16-divisible sizes it specialises on), ptxas and nvdisasm come with Triton.
Each backward branch is a loop; a row gives its instructions a pass, the tensor-core ops
(HGMMA) among them, and the commonest opcodes. Registers and stack (spills) per thread from
cuobjdump (the one-pass kernel at the launcher's bound, router_buffer.MAXNREG, and
unbounded). The main loop is the one with HGMMA after the z projection's. Static counts, not
times: the measured candidates pass (0.98 ms at 415 instructions a tile, NOTES) and the
prototype's skeleton give the scale.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {"X": "*bf16", "W": "*bf16", "R2": "*bf16", "R1": "*bf16", "OUT_VAL": "*fp32",
        "OUT_IDX": "*i32", "OUT_GATE": "*fp32", "REDO": "*i32", "REDO_N": "*i32",
        "CAND": "*fp32", "ZOUT": "*bf16", "OUT_M": "*fp32", "OUT_NORM": "*fp32",
        "OV": "*fp32", "OI": "*i32"}
ONES = ("sx_h", "sw_k", "s2_h")           # unit strides: the JIT makes them constants


def compile_sass(fn, const: dict, folder: str, name: str, warps=4, stages=3,
                 maxnreg=None) -> dict:
    names = list(inspect.signature(fn.fn).parameters)
    const = {**const, **{o: 1 for o in ONES if o in names}}
    sig, attrs = {}, {}
    for i, p in enumerate(names):
        sig[p] = "constexpr" if p in const else PTRS.get(p, "i32")
        if p not in const and p != "N":           # N: any batch size
            attrs[(i,)] = [["tt.divisibility", 16]]
    c = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages,
                                "maxnreg": maxnreg})
    cubin = os.path.join(folder, name + ".cubin")
    with open(cubin, "wb") as f:
        f.write(c.asm["cubin"])
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True,
                          text=True, check=True).stdout
    return {"name": name, "regs": int(m[1]), "stack": int(m[2]), "loops": loops(sass)}


def loops(sass: str) -> list[dict]:
    """Each backward branch's body: [start, branch] addresses, size, HGMMA, top opcodes."""
    ins, label_at, pending = [], {}, []
    for line in sass.splitlines():
        lab = re.match(r"^(\.L_x_\d+):", line)
        if lab:
            pending.append(lab[1])
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m[1], 16)
            for p in pending:
                label_at[p] = addr
            pending = []
            text = re.sub(r"^@!?U?P[T0-9]+\s+", "", m[2].strip())
            ins.append((addr, text.split()[0] if text else "", text))
    out = []
    for addr, op, text in ins:
        target = re.search(r"(\.L_x_\d+)", text) if op.startswith("BRA") else None
        if target and label_at.get(target[1], addr) < addr:
            lo = label_at[target[1]]
            ops = collections.Counter(o.split(".")[0] for a, o, _ in ins if lo <= a <= addr)
            out.append({"start": lo, "end": addr, "instructions": sum(ops.values()),
                        "hgmma": ops["HGMMA"], "top": ops.most_common(8)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="experts a token (1-8; default 4)")
    ap.add_argument("--anchors", help="folder of the anchor programs: adds the prototype")
    args = ap.parse_args(argv)
    if not 1 <= args.k <= 8:
        ap.error(f"--k must be in [1, 8], got {args.k}")
    from moremoe.kernels import router_buffer as rb, router_candidates as rc
    K, KP = args.k, 1 << (args.k - 1).bit_length()
    common = dict(MODE=0, BN=64, BM=128, BR=64, BH=64, PREC="tf32", EVEN=True, FULL_R=True,
                  LANEB=6, TUPLE=True)
    lazy, eager = (dict(K=K, KP=KP, C=2, EAGER=e, EVEN_H=True, **common)
                   for e in (False, True))
    builds = [(rc._candidates_kernel, dict(C=2, STATS=False, **common), "candidates C=2", None),
              (rb._buffer_kernel, lazy, "one pass, lazy", rb.MAXNREG),
              (rb._buffer_kernel, eager, "one pass, eager", rb.MAXNREG),
              (rb._buffer_kernel, lazy, "one pass, lazy, registers unbounded", None)]
    if K >= 3:
        builds.append((rb._buffer_kernel, {**lazy, "C": 4}, "one pass, four keys a tile, lazy",
                       rb.MAXNREG))
    if args.anchors:
        sys.path.insert(0, args.anchors)
        import fast_router
        builds.append((fast_router.router_topcf,
                       dict(R=64, K=max(K, 4), BN=64, BM=128, BH=64, C=2, EXACT=1, PAIRS=0,
                            EVEN_M=1, LANEB=6, PF=0, FLOOR=0, IFR=1, MMAA=0),
                       f"prototype (k={max(K, 4)})", None))
    with tempfile.TemporaryDirectory() as folder:
        for i, (fn, const, name, maxnreg) in enumerate(builds):
            r = compile_sass(fn, const, folder, f"k{i}", maxnreg=maxnreg)
            print(f"{name}: {r['regs']} registers, {r['stack']} bytes of stack")
            for lp in r["loops"]:
                top = ", ".join(f"{o} {n}" for o, n in lp["top"])
                print(f"  loop {lp['start']:#07x}-{lp['end']:#07x}: {lp['instructions']:5d} "
                      f"instructions, {lp['hgmma']} HGMMA; {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
