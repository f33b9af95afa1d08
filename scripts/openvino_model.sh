#!/usr/bin/env bash
# Converts SmolLM2-135M (scripts/model.sh's GGUF) to the OpenVINO IR that OpenVINO GenAI runs, as its
# users convert a model: transformers dequantizes the GGUF into a float32 model (the weights
# kvpress's side runs), `optimum-cli export openvino --weight-format fp32` exports it. Once, under
# ~/.cache/infkv/models (about a minute); prints the folder. The export's environment reuses the
# torch and transformers of scripts/python_env.sh (a .pth to its site-packages: no second torch)
# and adds optimum-intel, nncf and OpenVINO, keyed by both. OpenVINO GenAI also reads the GGUF
# directly, but on these prompts its answers fall apart at 2K tokens where the exported IR's match
# llama.cpp's (docs/evaluation.md): the IR is what the side by side runs. OpenVINO's tokenizer
# converter fails on this tokenizer, so the IR comes without one; the token ids are given, and
# scripts/peers_single_turn.py decodes answers with the folder's tokenizer.json.
#   scripts/openvino_model.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gguf=$("$here/model.sh" smollm2 | tail -n 1)
pyenv=$("$here/python_env.sh" | tail -n 1)
root=${INFKV_CACHE:-$HOME/.cache/infkv}
versions="optimum-intel==2.2.0 optimum==2.3.0 | nncf==3.4.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0"
key=$(echo "$versions $pyenv" | sha1sum | cut -c1-12)
env=$root/openvino-export-$key
if [ ! -e "$env/.complete" ]; then
  echo "infkv openvino model: creating $env ($versions; torch and transformers from $pyenv)" >&2
  rm -rf "$env"
  python3 -m venv "$env"
  site=$("$pyenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/infkv-python-env.pth"
  # optimum-intel asks for torchvision (not used for a text model) and an older huggingface-hub: no deps
  "$env/bin/python" -m pip install -q --no-deps ${versions%%|*} >&2
  "$env/bin/python" -m pip install -q ${versions##*|} >&2
  touch "$env/.complete"
fi
out=$root/models/$(basename "$gguf" .gguf)-openvino-$key
if [ ! -e "$out/.complete" ]; then
  echo "infkv openvino model: exporting $gguf to $out" >&2
  rm -rf "$out" "$out.hf"
  TQDM_DISABLE=1 "$env/bin/python" - "$gguf" "$out.hf" <<'PY' >&2
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(gguf), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config  # the weights are dequantized
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
PY
  TQDM_DISABLE=1 "$env/bin/optimum-cli" export openvino --model "$out.hf" --task text-generation-with-past \
    --weight-format fp32 "$out" >&2
  rm -rf "$out.hf"
  touch "$out/.complete"
fi
echo "$out"
