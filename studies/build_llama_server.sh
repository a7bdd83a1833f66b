#!/usr/bin/env bash
# llama.cpp's own C++ server (llama-server), built from the llama.cpp vendored in the
# pinned llama-cpp-python sdist, with the instruction-set flags the Makefile gives the
# Python build: the same llama.cpp commit and the same kernels as kvgate's local backend,
# so that studies/llama_server_anchor.py compares servers, not builds. Nothing but that
# sdist is fetched (pip's index, or its cache). Run through `make llama-server`.
#
#   OUT (default .cache/llama-server): where the sdist, the build and the binary go
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^LLAMA_CPP_PYTHON := llama-cpp-python==//p' Makefile)
OUT=${OUT:-.cache/llama-server}
mkdir -p "$OUT/sdist"
SDIST=$(ls "$OUT"/sdist/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ]; then
  .venv/bin/pip download "llama-cpp-python==$VERSION" --no-deps --no-binary llama-cpp-python -d "$OUT/sdist"
  SDIST="$OUT/sdist/llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$OUT/src/llama_cpp_python-$VERSION"
if [ ! -d "$SRC" ]; then
  mkdir -p "$OUT/src"
  tar -xzf "$SDIST" -C "$OUT/src"
fi
echo "building llama-server $VERSION (vendored llama.cpp) with: ${CMAKE_ARGS:-the defaults of llama.cpp}"
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  ${CMAKE_ARGS:-}
cmake --build "$OUT/build" --target llama-server -j "$(nproc)"
cp "$OUT/build/bin/llama-server" "$OUT/llama-server"
echo "llama-server: $OUT/llama-server"
