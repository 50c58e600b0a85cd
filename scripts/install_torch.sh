#!/bin/sh
# Install PyTorch into the environment of the given Python, never pulling the multi-gigabyte
# CUDA build onto a machine that has no NVIDIA GPU.
#   with a GPU (nvidia-smi answers):  torch>=2.4 from the default index (CUDA build)
#   without a GPU:                    torch==2.13.0, the CPU build: from PyTorch's CPU index
#                                     when it is reachable, else from the configured indexes
#                                     (which may hold a local CPU wheel)
# Override with TORCH_SPEC (and TORCH_INDEX_URL).
set -eu
PY="${1:-python3}"
if "$PY" -c "import torch" 2>/dev/null; then
    echo "install_torch: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
    exit 0
fi
if [ -n "${TORCH_SPEC:-}" ]; then
    exec "$PY" -m pip install "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    exec "$PY" -m pip install "torch>=2.4"
fi
if "$PY" -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
    exec "$PY" -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
        --extra-index-url https://pypi.org/simple
fi
exec "$PY" -m pip install torch==2.13.0
