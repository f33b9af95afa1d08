#!/usr/bin/env bash
# Fetches llama.cpp (as vendored by the llama-cpp-python sdist on PyPI), builds its CPU-only shared
# libraries (llama, ggml, mtmd) and installs them into the infkv cache. Idempotent: a completed
# build is reused at once. The last line on stdout is the install prefix, to be passed to CMake as
# CMAKE_PREFIX_PATH together with -DINFKV_WITH_LLAMA_CPP=ON.
#
# Environment: INFKV_CACHE (default ~/.cache/infkv), INFKV_LLAMA_JOBS (default 2).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
v=$LLAMA_CPP_PYTHON_VERSION
cache=${INFKV_CACHE:-$HOME/.cache/infkv}
jobs=${INFKV_LLAMA_JOBS:-2}
dl=$cache/dl
root=$cache/llama.cpp-$v
src=$root/src
prefix=$root/prefix
stamp=$root/complete.stamp

if [ -f "$stamp" ] && [ -f "$prefix/lib/cmake/llama/llama-config.cmake" ]; then
  echo "$prefix"
  exit 0
fi

sdist=$dl/llama_cpp_python-$v.tar.gz
if [ ! -f "$sdist" ]; then
  mkdir -p "$dl"
  echo "infkv llama.cpp: downloading llama-cpp-python==$v (source distribution)" >&2
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$v" -d "$dl" >&2
fi

if [ ! -f "$src/CMakeLists.txt" ]; then
  echo "infkv llama.cpp: extracting vendor/llama.cpp" >&2
  rm -rf "$src" "$root/extract"
  mkdir -p "$root/extract"
  tar -xzf "$sdist" -C "$root/extract" "llama_cpp_python-$v/vendor/llama.cpp"
  mv "$root/extract/llama_cpp_python-$v/vendor/llama.cpp" "$src"
  rm -rf "$root/extract"
fi

echo "infkv llama.cpp: building CPU-only shared libraries with $jobs jobs (several minutes)" >&2
start=$(date +%s)
cmake -S "$src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_RPATH='$ORIGIN' \
  -DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_MTMD=ON >&2
nice -n 10 cmake --build "$root/build" -j "$jobs" --target llama ggml mtmd >&2
cmake --install "$root/build" >&2
echo "infkv llama.cpp: built in $(( $(date +%s) - start )) s" >&2
date -u +%Y-%m-%dT%H:%M:%SZ >"$stamp"
echo "$prefix"
