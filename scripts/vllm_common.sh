# Sourced (from the repository root) by the scripts that run infkv in vLLM: vLLM's environment
# (scripts/vllm_env.sh) with this package built into it, and the real model and text they use.
# Sets env (the environment), model (SmolLM2 converted for vLLM) and text (the KJV).
env=$(scripts/vllm_env.sh)
"$env/bin/python" -m pip install --quiet --no-build-isolation . >&2
model=$(scripts/vllm_model.sh | tail -n 1)
text=$(scripts/kjv.sh | tail -n 1)
