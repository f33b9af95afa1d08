#!/usr/bin/env bash
# Converts a small real model to the safetensors folder vLLM loads (vLLM no longer reads GGUF):
# transformers dequantizes scripts/model.sh's GGUF into a float32 model, saved with its tokenizer
# under ~/.cache/infkv/models (once; about 40 s). Prints the folder. Runs in scripts/vllm_env.sh's
# environment.
#   scripts/vllm_model.sh            SmolLM2-135M-Instruct
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
which=${1:-smollm2}
[ "$which" = smollm2 ] || { echo "infkv vllm model: '$which' must be smollm2" >&2; exit 2; }
gguf=$("$here/model.sh" smollm2 | tail -n 1)
env=$("$here/vllm_env.sh" | tail -n 1)
cache=${INFKV_CACHE:-$HOME/.cache/infkv}
out=$cache/models/$(basename "$gguf" .gguf)-$(basename "$env")
if [ ! -e "$out/.complete" ]; then
  echo "infkv vllm model: converting $gguf to $out" >&2
  rm -rf "$out"
  "$env/bin/python" - "$gguf" "$out" <<'PY' >&2
import sys, os
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(gguf), os.path.basename(gguf)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
config = AutoConfig.from_pretrained(folder, gguf_file=name)
if hasattr(config, "quantization_config"):
    del config.quantization_config  # the weights are dequantized: vLLM must not look for GGUF ones
config.dtype = torch.float32
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
PY
  touch "$out/.complete"
fi
echo "$out"
