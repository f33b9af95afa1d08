# Sourced (from the repository root) by the scripts that run a llama.cpp model on the KJV text:
# installs what they need, configures the release build with the llama.cpp adapter, and sets
# $prefix (the pinned llama.cpp), $model (SmolLM2-135M-Instruct) and $text (the KJV text).
scripts/setup.sh
prefix=$(scripts/llama_cpp.sh | tail -1)
model=$(scripts/model.sh | tail -1)
text=$(scripts/kjv.sh | tail -1)
cmake --preset release -DINFKV_WITH_LLAMA_CPP=ON -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
