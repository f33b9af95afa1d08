#!/usr/bin/env bash
# Everything infkv checks on a machine with an NVIDIA GPU, in one command of a few minutes:
# the GPU, a build for its architecture with every core, the GPU parity tests (REQUIRE_GPU=1: a
# missing device fails), the CUDA steps' host tests, compute-sanitizer memcheck and racecheck on
# small shapes, the paged-engine example and the benchmarks; a JSON summary goes to OUT_DIR.
#
#   scripts/gpu_check.sh OUT_DIR [CUDA_ARCH]        (CUDA_ARCH: 90 for an H200, the default)
#
# Machines without doctest / Google Benchmark / fmt / CLI11 / nlohmann-json: run
# scripts/gpu_deps.sh on a build machine first and carry build/gpu-deps with the tree.
# Every step runs even when an earlier one fails; the exit status is that of the first failure.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [CUDA_ARCH]}
arch=${2:-90}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
: > "$out/steps.jsonl"
prefix=()
if [ -d build/gpu-deps/usr ]; then
  prefix=("-DCMAKE_PREFIX_PATH=$PWD/build/gpu-deps/usr")
  export LD_LIBRARY_PATH="$PWD/build/gpu-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
first_failure=0
step() {  # step NAME COMMAND...: output to OUT_DIR/NAME.log, a line of steps.jsonl
  local name=$1 start rc
  shift
  echo "== $name: $*" >&2
  start=$(date +%s%N)
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "ms": %d}\n' "$name" "$rc" $((($(date +%s%N) - start) / 1000000)) >>"$out/steps.jsonl"
  [ "$rc" -ne 0 ] && { echo "   $name failed (rc $rc): tail of $out/$name.log" >&2; tail -n 20 "$out/$name.log" >&2; }
  [ "$rc" -ne 0 ] && [ "$first_failure" -eq 0 ] && first_failure=$rc
  return 0
}
b=build/gpu
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
step gpu nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
step configure cmake -S . -B $b "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DINFKV_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DINFKV_BUILD_TESTS=ON -DINFKV_BUILD_EXAMPLES=ON -DINFKV_BUILD_TOOLS=OFF -DINFKV_BUILD_BENCH=ON -DINFKV_NVCC_HEADER_CHECK=OFF "${prefix[@]}"
step build cmake --build $b -j "$(nproc)" --target infkv_gpu_tests infkv_tests infkv_bench_cuda infkv_example_cuda_paged
step gpu_tests env REQUIRE_GPU=1 ctest --test-dir $b -L gpu --output-on-failure
step host_steps $b/tests/infkv_tests --test-case='cuda steps*'
if command -v compute-sanitizer >/dev/null; then
  step memcheck env INFKV_GPU_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 $b/tests/infkv_gpu_tests
  step racecheck env INFKV_GPU_SMALL=1 compute-sanitizer --tool racecheck --error-exitcode 1 $b/tests/infkv_gpu_tests \
    --test-case='*keep sets*'
else
  printf '{"step": "memcheck", "rc": -1, "ms": 0, "note": "no compute-sanitizer"}\n' >>"$out/steps.jsonl"
fi
step example $b/examples/infkv-example-cuda-paged 8192
step bench $b/bench/infkv_bench_cuda --benchmark_out="$out/bench_cuda.json" --benchmark_out_format=json \
  --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
python3 - "$out" <<'PY' || true
import json, os, sys
out = sys.argv[1]
steps = [json.loads(l) for l in open(os.path.join(out, "steps.jsonl")) if l.strip()]
summary = {"steps": steps}
gpu_log = os.path.join(out, "gpu.log")
if os.path.exists(gpu_log):
    summary["gpu"] = open(gpu_log).read().strip().splitlines()[-1:]
bench = os.path.join(out, "bench_cuda.json")
if os.path.exists(bench):
    data = json.load(open(bench))
    summary["context"] = {k: data["context"].get(k) for k in ("copy_bytes_per_s", "gemm_f16_flop_per_s")}
    rows = []
    for b in data["benchmarks"]:
        if b.get("aggregate_name", "median") != "median":
            continue
        row = {"name": b["run_name"], "time_us": round(b["real_time"], 2)}
        for key in ("of_copy", "of_gemm", "flop_per_s", "bytes_per_s"):
            if key in b:
                row[key] = b[key]
        rows.append(row)
    summary["benchmarks"] = rows
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
exit "$first_failure"
