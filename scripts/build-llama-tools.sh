#!/usr/bin/env bash
# llama.cpp's llama-server and ggml-rpc-server for bench:wan, built from the llama.cpp source node-llama-cpp ships
# (node_modules/node-llama-cpp/llama/gitRelease.bundle, the same release as its libraries), into DIR/bin
# (default .cache/llama-tools). Afterwards the built CPU backend is replaced by node-llama-cpp's libggml-cpu-*.so
# variants (ggml loads the best one the CPU supports): a native build dies on SIGILL on some VMs (AMX), and a build
# without native flags is about half as fast. Prints the bin folder on its last line; does nothing when both tools
# are there already. Needs git, cmake, ninja and a C++ compiler; takes a while (JOBS parallel jobs, default 2).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$root/.cache/llama-tools}"
jobs="${JOBS:-2}"
bin="$dir/build/bin"
if [[ -x "$bin/llama-server" && -x "$bin/ggml-rpc-server" ]]; then
  echo "$bin"
  exit 0
fi
bundle="$root/node_modules/node-llama-cpp/llama/gitRelease.bundle"
[[ -f "$bundle" ]] || { echo "build-llama-tools: $bundle is missing (npm install first)" >&2; exit 1; }
for tool in git cmake ninja c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-tools: $tool is not installed" >&2; exit 1; }
done
mkdir -p "$dir"
[[ -d "$dir/src/.git" ]] || git clone --quiet "$bundle" "$dir/src"
cmake -S "$dir/src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF \
  -DGGML_RPC=ON -DLLAMA_CURL=OFF >/dev/null
ninja -C "$dir/build" -j "$jobs" llama-server ggml-rpc-server
variants=$(ls "$root"/node_modules/@node-llama-cpp/linux-x64/bins/*/libggml-cpu-*.so 2>/dev/null || true)
if [[ -n "$variants" ]]; then
  rm -f "$bin/libggml-cpu.so"
  cp $variants "$bin/"
else
  echo "build-llama-tools: no node-llama-cpp libggml-cpu-*.so found; keeping the built CPU backend" >&2
fi
echo "$bin"
