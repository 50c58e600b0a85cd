#!/bin/sh
# Install moremoe (editable, with EXTRAS) and what it needs into the environment of a Python:
#
#   sh scripts/install.sh PYTHON MODE [EXTRAS]      (EXTRAS default: test)
#
#   locked  make demo, make test: the exact versions of requirements/lock-cpu.txt, the set
#           the test suite passed with (regenerate it with `make lock`)
#   latest  make test-latest, make lock: the newest versions pyproject.toml allows
#   lowest  make test-lowest: every direct dependency at its lower bound in pyproject.toml
#           (requirements/lowest.txt; tests/test_install.py keeps the two equal)
#
# PyTorch comes first and never as the multi-gigabyte CUDA build on a machine without an
# NVIDIA GPU: without one, the CPU build of the lock's version (latest: the newest CPU
# build) from PyTorch's CPU index when it is reachable, else that version from the
# configured indexes (which may hold a local CPU wheel); with one, the default build (a
# torch already installed there is kept in locked mode). On a GPU machine the lock's torch
# and triton pins are left out: the CUDA build of torch pins its own triton. TORCH_SPEC (and TORCH_INDEX_URL) override the PyTorch line.
set -eu
PY="$1"
MODE="${2:-locked}"
EXTRAS="${3:-test}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
LOCK="$ROOT/requirements/lock-cpu.txt"
LOWEST="$ROOT/requirements/lowest.txt"
CPU_INDEX=https://download.pytorch.org/whl/cpu

case "$MODE" in
    locked|latest|lowest) ;;
    *) echo "install.sh: MODE must be locked, latest or lowest, got '$MODE'" >&2; exit 2 ;;
esac
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
cpu_index=0
if [ "$gpu" = 0 ] && "$PY" -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" \
        2>/dev/null; then cpu_index=1; fi
locked_torch="$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' "$LOCK")"
lowest_torch="$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' "$LOWEST")"

# 1. PyTorch
if [ -n "${TORCH_SPEC:-}" ]; then
    spec="$TORCH_SPEC"
elif [ "$gpu" = 0 ] && [ "$cpu_index" = 0 ]; then
    # PyPI has CUDA builds only: the lock's version, which the configured indexes must hold
    spec="torch==$locked_torch"
    [ "$MODE" = locked ] || echo "install.sh: PyTorch's CPU index is not reachable: torch" \
        "$locked_torch (the lock's CPU build) stands in for the $MODE one" >&2
elif [ "$MODE" = latest ]; then
    spec="torch>=$lowest_torch"
elif [ "$MODE" = lowest ]; then
    spec="torch==$lowest_torch"
else
    spec="torch==$locked_torch"
fi
if [ "$gpu" = 1 ] && [ "$MODE" = locked ] && [ -z "${TORCH_SPEC:-}" ] \
        && "$PY" -c "import torch" 2>/dev/null; then        # a CUDA build that is there already
    echo "install.sh: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$PY" -m pip install -q "$spec" --index-url "$TORCH_INDEX_URL"
elif [ "$cpu_index" = 1 ]; then
    "$PY" -m pip install -q "$spec" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
else
    "$PY" -m pip install -q "$spec"
fi

# 2. moremoe and everything else under the mode's constraints, and the torch of step 1
# kept as it is (an eager upgrade would swap it for PyPI's newest, a CUDA build)
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$constraints"
case "$MODE" in
    locked) if [ "$gpu" = 1 ]; then grep -v -E '^(torch|triton|nvidia-)' "$LOCK" >> "$constraints"
            else grep -v -E '^torch==' "$LOCK" >> "$constraints"; fi ;;
    lowest) grep -v -E '^torch==' "$LOWEST" >> "$constraints" ;;
    latest) ;;
esac
"$PY" -m pip install -q --upgrade --upgrade-strategy eager -c "$constraints" -e "$ROOT[$EXTRAS]"
"$PY" - "$MODE" <<'PY'
import importlib.metadata as md, sys
names = ("torch", "triton", "numpy", "transformers", "datasets", "lm_eval", "tiktoken")
got = []
for name in names:
    try:
        got.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print(f"install.sh ({sys.argv[1]}): " + ", ".join(got))
# installed is not enough: a package whose own dependencies came out incompatible (pyarrow
# built for numpy 2 beside numpy 1) fails on import, and the tests that need it would skip
broken = []
for name, module in (("numpy", "numpy"), ("pyarrow", "pyarrow"), ("datasets", "datasets"),
                     ("transformers", "transformers"), ("lm_eval", "lm_eval"),
                     ("triton", "triton"), ("safetensors", "safetensors.torch")):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001 - ImportError, or whatever the import raised
        broken.append(f"{module} ({type(err).__name__}: {' '.join(str(err).split())[:160]})")
if broken:
    sys.exit(f"install.sh ({sys.argv[1]}): installed but cannot be imported: "
             + "; ".join(broken) + "; the constraints of this mode do not fit together")
PY
