#!/usr/bin/env bash
# Creates (once) the Python environment infkv's Python-side tools use, under ~/.cache/infkv (outside
# the clone, keyed by the pinned versions: torch from PyPI is the CUDA build, about 6 GB installed,
# and runs on the CPU without a GPU), and prints its path. Idempotent.
set -euo pipefail
versions="torch==2.15.0 transformers==5.2.0 kvpress==0.5.5 gguf==0.19.0 sentencepiece==0.2.3 nanobind==3.1.0 scikit-build-core==1.1.2 pytest==9.2.0"
key=$(echo "$versions" | sha1sum | cut -c1-12)
root=${INFKV_CACHE:-$HOME/.cache/infkv}
env=$root/python-$key
if [ ! -x "$env/bin/python" ] || [ ! -e "$env/.complete" ]; then
  echo "infkv python: creating $env ($versions; a few minutes, about 3 GB to download)" >&2
  rm -rf "$env"
  python3 -m venv "$env"
  "$env/bin/python" -m pip install -q $versions >&2
  touch "$env/.complete"
fi
echo "$env"
