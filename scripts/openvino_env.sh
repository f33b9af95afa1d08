#!/usr/bin/env bash
# Creates (once) the Python environment of the OpenVINO GenAI peer (scripts/peers_single_turn.py
# openvino) under ~/.cache/infkv (outside the clone, keyed by the pinned versions; about 300 MB, no
# torch: it runs the IR scripts/openvino_model.sh exports, or a GGUF file), and prints its path.
# Idempotent. python/tests/test_peers.py creates it (seconds) and runs one question on the GGUF.
set -euo pipefail
versions="openvino-genai==2026.4.1.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 numpy==2.4.6 tokenizers==0.22.2"
key=$(echo "$versions" | sha1sum | cut -c1-12)
root=${INFKV_CACHE:-$HOME/.cache/infkv}
env=$root/openvino-$key
if [ ! -x "$env/bin/python" ] || [ ! -e "$env/.complete" ]; then
  echo "infkv openvino: creating $env ($versions; under a minute, about 100 MB to download)" >&2
  rm -rf "$env"
  python3 -m venv "$env"
  "$env/bin/python" -m pip install -q $versions >&2
  touch "$env/.complete"
fi
echo "$env"
