#!/usr/bin/env bash
# Everything infkv checks on a machine with an NVIDIA GPU, in one command of at most ~6.5 minutes:
# the GPU, a Release build of only what runs (for its architecture, every core), the benchmarks
# (medians of 3 beside a device copy and a cuBLAS GEMM), the GPU parity tests (REQUIRE_GPU=1: a
# missing device fails), the no-sync test (stub runtime), the paged-engine example, and
# compute-sanitizer memcheck, racecheck, initcheck and synccheck on small shapes
# (INFKV_GPU_SMALL=1).
#
#   scripts/gpu_check.sh OUT_DIR [CUDA_ARCH]        (CUDA_ARCH: 90 for an H200, the default)
#
# OUT_DIR gets three files, each rewritten as the check goes, so a run killed by its caller still
# returns what it did: summary.json (per step: name, rc, ms, status ok / failed / timeout /
# skipped / running, reason, log; the nvidia-smi line; the benchmark medians and ceilings),
# bench_cuda.json (Google Benchmark's JSON) and logs.tar.gz (every step's log); and ncu.csv
# (Nsight Compute's metrics of the reference eviction's kernels) when ncu is installed.
# Every step has a time limit and none runs past the budget (GPU_CHECK_BUDGET_S, 390 s); a failed
# configure or build skips what needs it, a failed test step does not stop the others. Without a
# GPU the GPU steps are skipped ("no GPU"), and so is the build unless GPU_CHECK_BUILD=1 (on a slow
# build machine raise GPU_CHECK_BUILD_LIMIT_S, 200 s, and GPU_CHECK_BUDGET_S with it). Exit
# status: 0 when no step failed or timed out (skips are not failures), 1 otherwise, 2 when a
# dependency is missing. A machine without doctest / Google Benchmark / fmt / CLI11 /
# nlohmann-json: run scripts/gpu_deps.sh on a build machine and carry build/gpu-deps.
set -uo pipefail
usage="usage: scripts/gpu_check.sh OUT_DIR [CUDA_ARCH]"
out=${1:?$usage}
arch=${2:-90}
budget=${GPU_CHECK_BUDGET_S:-390}
jobs=${GPU_CHECK_JOBS:-$(nproc)}
t0=$(date +%s)
deadline=$((t0 + budget))
if ! mkdir -p "$out" || ! out=$(cd "$out" && pwd); then echo "gpu_check: cannot create $1" >&2; exit 2; fi
cd "$(dirname "$0")/.." || exit 2
root=$PWD
b=build/gpu
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
trap 'rm -rf "$logs"' EXIT
rm -f "$out/summary.json" "$out/bench_cuda.json" "$out/logs.tar.gz"

# --- Step records, summary.json and logs.tar.gz -------------------------------------------------
names=() rcs=() mss=() statuses=() reasons=() logfiles=()
failed=0 finished=false interrupted="" child="" have_gpu=0
json_str() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; printf '"%s"' "${s//$'\n'/ }"; }
steps_json() {
  local i sep=""
  printf '['
  for i in "${!names[@]}"; do
    printf '%s\n {"name": %s, "rc": %d, "ms": %d, "status": %s, "reason": %s, "log": %s}' "$sep" \
      "$(json_str "${names[i]}")" "${rcs[i]}" "${mss[i]}" "$(json_str "${statuses[i]}")" \
      "$(json_str "${reasons[i]}")" "$(json_str "${logfiles[i]}")"
    sep=,
  done
  printf '\n]\n'
}
# record INDEX NAME RC MS STATUS REASON LOG
record() { names[$1]=$2 rcs[$1]=$3 mss[$1]=$4 statuses[$1]=$5 reasons[$1]=$6 logfiles[$1]=$7; }

# Rewrites OUT_DIR/summary.json (through a temporary file: never half written) and logs.tar.gz.
publish() {
  steps_json >"$logs/steps.json"
  if command -v python3 >/dev/null; then
    GC_OUT=$out GC_LOGS=$logs GC_ARCH=$arch GC_BUDGET=$budget GC_GPU=$have_gpu GC_FINISHED=$finished \
      GC_INTERRUPTED=$interrupted GC_ELAPSED=$(($(date +%s) - t0)) timeout 30 python3 - <<'PY' || echo "gpu_check: summary not written" >&2
import json, os, shutil
e = os.environ
out, logs = e["GC_OUT"], e["GC_LOGS"]
steps = json.load(open(os.path.join(logs, "steps.json")))
summary = {"finished": e["GC_FINISHED"] == "true", "interrupted_by": e["GC_INTERRUPTED"] or None, "elapsed_s": int(e["GC_ELAPSED"]), "budget_s": int(e["GC_BUDGET"]),
           "cuda_arch": e["GC_ARCH"], "gpu_found": e["GC_GPU"] == "1", "steps": steps}
for s in steps:  # the nvidia-smi line, as the query printed it
    if s["name"] == "gpu" and s["status"] == "ok":
        lines = open(os.path.join(logs, s["log"]), errors="replace").read().strip().splitlines()
        summary["gpu"] = lines[-1:]
bench = os.path.join(logs, "bench_cuda.json")
if os.path.exists(bench):
    try:
        data = json.load(open(bench))
        ctx = data.get("context", {})
        summary["context"] = {k: float(ctx[k]) if k in ctx else None for k in ("copy_bytes_per_s", "gemm_f16_flop_per_s")}
        rows = []
        for row in data.get("benchmarks", []):
            if row.get("aggregate_name", "median") != "median":
                continue
            r = {"name": row.get("run_name", row["name"]), "time_us": round(row["real_time"], 2)}
            for key in ("of_copy", "of_gemm", "flop_per_s", "bytes_per_s"):
                if key in row:
                    r[key] = row[key]
            rows.append(r)
        summary["benchmarks"] = rows
        shutil.copyfile(bench, os.path.join(out, "bench_cuda.json"))
    except (ValueError, KeyError) as err:  # a benchmark run cut short leaves its JSON unfinished
        summary["benchmarks_error"] = f"bench_cuda.json unreadable: {err}"
tmp = os.path.join(out, ".summary.json.part")
json.dump(summary, open(tmp, "w"), indent=1)
os.replace(tmp, os.path.join(out, "summary.json"))
PY
  else  # no python3 (the dependency check stops the run): the steps alone
    { printf '{"finished": %s, "gpu_found": %s, "steps": ' "$finished" "$([ "$have_gpu" = 1 ] && echo true || echo false)"
      cat "$logs/steps.json"; printf '}\n'; } >"$out/.summary.json.part" && mv -f "$out/.summary.json.part" "$out/summary.json"
  fi
  tar -czf "$out/.logs.tar.gz.part" -C "$logs" . && mv -f "$out/.logs.tar.gz.part" "$out/logs.tar.gz"
}

# Prints the outcome and the files written; exits with STATUS.
finish() {
  finished=true
  publish
  echo "== gpu_check: $(($(date +%s) - t0)) s of a ${budget} s budget" >&2
  local i
  for i in "${!names[@]}"; do
    printf '   %-11s %-8s %7d ms  %s\n' "${names[i]}" "${statuses[i]}" "${mss[i]}" "${reasons[i]}" >&2
  done
  echo "== files written to $out:" >&2
  find "$out" -maxdepth 1 -type f -printf '   %f (%s bytes)\n' | sort >&2
  exit "$1"
}

# Killed by the caller: the step in flight is stopped and recorded as timed out, the rest skipped.
# shellcheck disable=SC2317  # called by the traps below
on_signal() {
  trap '' TERM INT HUP
  interrupted=$1
  [ -n "$child" ] && kill -TERM "$child" 2>/dev/null && wait "$child" 2>/dev/null
  local i=${#names[@]}
  [ "$i" -gt 0 ] && [ "${statuses[i - 1]}" = running ] &&
    record $((i - 1)) "${names[i - 1]}" 143 "$(($(date +%s%N) / 1000000 - step_start_ms))" timeout "gpu_check was sent $1" "${logfiles[i - 1]}"
  finish 143
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT
trap 'on_signal SIGHUP' HUP

# why_not: why the next step cannot run ("" when it can), set by `requires`.
why_not=""
requires() {  # requires gpu | build | sanitizer ...
  local r
  why_not=""
  for r in "$@"; do
    case $r in
      gpu) [ "$have_gpu" = 1 ] || why_not="no GPU" ;;
      build) why_not=$build_blocked ;;
      sanitizer) [ -n "$sanitizer" ] || why_not="compute-sanitizer not found (in PATH or the CUDA toolkit)" ;;
      ncu) [ -n "$ncu" ] || why_not="ncu (Nsight Compute) not found (in PATH or the CUDA toolkit)" ;;
    esac
    [ -n "$why_not" ] && return
  done
}

# step NAME LIMIT_S CMD...: runs CMD under `timeout` (LIMIT_S, or what is left of the budget),
# its output in the step's log; records name, rc, ms, status, reason and publishes the summary.
# Skipped when `requires` said why (or the budget is spent). Returns CMD's status (0 if skipped).
step_start_ms=0
step() {
  local name=$1 limit=$2 i=${#names[@]} reason=$why_not left rc status
  shift 2
  why_not=""
  local log
  log=$(printf '%02d_%s.log' "$i" "$name")
  left=$((deadline - $(date +%s)))
  [ -z "$reason" ] && [ "$left" -lt 10 ] && reason="the ${budget} s budget is spent"
  if [ -n "$reason" ]; then
    echo "== $name: skipped ($reason)" >&2
    record "$i" "$name" 0 0 skipped "$reason" ""
    publish
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  record "$i" "$name" 0 0 running "limit ${limit} s" "$log"
  publish
  echo "== $name (at most ${limit} s): $*" >&2
  step_start_ms=$(($(date +%s%N) / 1000000))
  timeout -k 5 "$limit" "$@" >"$logs/$log" 2>&1 </dev/null &
  child=$!
  wait "$child"
  rc=$?
  child=""
  local ms=$(($(date +%s%N) / 1000000 - step_start_ms))
  if [ "$rc" -eq 0 ]; then status=ok reason=""
  elif [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$ms" -ge $((limit * 1000)) ]; }; then
    status=timeout reason="stopped after ${limit} s"
  else status=failed reason="exit status $rc"
  fi
  record "$i" "$name" "$rc" "$ms" "$status" "$reason" "$log"
  publish
  if [ "$rc" -ne 0 ]; then
    failed=1
    echo "   $name: $status ($reason); the end of its log:" >&2
    tail -n 20 "$logs/$log" >&2
  fi
  return "$rc"
}

# --- Dependencies: all found, or stop here saying how to bring them --------------------------------
missing=()
command -v python3 >/dev/null || missing+=("python3 (install python3)")
if command -v cmake >/dev/null; then
  v=$(cmake --version | sed -n '1s/[^0-9]*\([0-9]*\.[0-9]*\).*/\1/p')
  [ "$(printf '%s\n3.25\n' "$v" | sort -V | head -n1)" = 3.25 ] || missing+=("cmake >= 3.25 (found $v)")
else
  missing+=("cmake >= 3.25 (install cmake)")
fi
if command -v ninja >/dev/null; then gen=Ninja
elif command -v make >/dev/null; then gen="Unix Makefiles"
else missing+=("ninja or make (install ninja-build)"); fi
command -v c++ >/dev/null || command -v g++ >/dev/null || missing+=("a C++ compiler (install g++)")
cuda_home=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
command -v nvcc >/dev/null || export PATH="$cuda_home/bin:/usr/local/cuda/bin:$PATH"
nvcc=$(command -v nvcc) || missing+=("nvcc (install the CUDA toolkit, or set CUDA_HOME)")
sanitizer=$(command -v compute-sanitizer)
for d in "$cuda_home/bin" "$cuda_home/compute-sanitizer" /usr/local/cuda/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$d/compute-sanitizer" ] && sanitizer=$d/compute-sanitizer
done
ncu=$(command -v ncu)
[ -z "$ncu" ] && [ -x "$cuda_home/bin/ncu" ] && ncu=$cuda_home/bin/ncu
prefixes=()
if [ -d build/gpu-deps/usr ]; then
  prefixes+=("$root/build/gpu-deps/usr")
  export LD_LIBRARY_PATH="$root/build/gpu-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
IFS=: read -r -a env_prefixes <<<"${CMAKE_PREFIX_PATH:-}"
prefixes+=("${env_prefixes[@]}" /usr/local /usr)
for pkg in doctest benchmark fmt CLI11 nlohmann_json; do  # their CMake package files
  found=""
  for p in "${prefixes[@]}"; do
    [ -n "$p" ] || continue
    compgen -G "$p/lib/cmake/$pkg/*onfig.cmake" >/dev/null || compgen -G "$p/lib*/*/cmake/$pkg/*onfig.cmake" >/dev/null ||
      compgen -G "$p/lib64/cmake/$pkg/*onfig.cmake" >/dev/null || compgen -G "$p/share/cmake/$pkg/*onfig.cmake" >/dev/null ||
      continue
    found=$p && break
  done
  [ -n "$found" ] || missing+=("$pkg (run scripts/gpu_deps.sh on a build machine and carry build/gpu-deps)")
done
if [ "${#missing[@]}" -gt 0 ]; then
  {
    echo "gpu_check: missing, nothing was run:"
    printf '   %s\n' "${missing[@]}"
  } | tee "$logs/00_dependencies.log" >&2
  record 0 dependencies 2 0 failed "missing: $(IFS=';'; echo "${missing[*]}")" 00_dependencies.log
  finish 2
fi

# --- The steps ---------------------------------------------------------------------------------
if timeout 20 nvidia-smi -L >"$logs/gpu_list.log" 2>&1 && grep -q '^GPU ' "$logs/gpu_list.log"; then have_gpu=1; fi
build_blocked=""  # why nothing can be built ("" once configured and built)
[ "$have_gpu" = 1 ] || [ "${GPU_CHECK_BUILD:-0}" = 1 ] || build_blocked="no GPU (GPU_CHECK_BUILD=1 builds anyway)"
prefix_arg=()
[ -d build/gpu-deps/usr ] && prefix_arg=("-DCMAKE_PREFIX_PATH=$root/build/gpu-deps/usr")
gpu=(env REQUIRE_GPU=1)
small=(env REQUIRE_GPU=1 INFKV_GPU_SMALL=1)
san=("${sanitizer:-compute-sanitizer}" --error-exitcode 1 --print-limit 20)

requires gpu
step gpu 15 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
# A cache from another generator or another place of the tree cannot be reused: start afresh.
if [ -f "$b/CMakeCache.txt" ] && ! { grep -qx "CMAKE_GENERATOR:INTERNAL=$gen" "$b/CMakeCache.txt" &&
  grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$b/CMakeCache.txt"; }; then rm -rf "$b"; fi
requires build
step configure 60 cmake -S . -B "$b" -G "$gen" -DCMAKE_BUILD_TYPE=Release -DINFKV_WITH_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch" -DINFKV_BUILD_TESTS=ON -DINFKV_BUILD_EXAMPLES=ON \
  -DINFKV_BUILD_TOOLS=OFF -DINFKV_BUILD_BENCH=ON -DINFKV_NVCC_HEADER_CHECK=OFF -DINFKV_HOST_STEPS_TESTS=OFF \
  "${prefix_arg[@]}" ||
  build_blocked="configure ${statuses[-1]}"
requires build
step build "${GPU_CHECK_BUILD_LIMIT_S:-200}" cmake --build "$b" -j "$jobs" --target infkv_gpu_tests infkv_nosync_tests infkv_bench_cuda infkv_example_cuda_paged ||
  build_blocked="build ${statuses[-1]}"
# The benchmarks first: the step most likely to be cut by the budget is a sanitizer's, not them.
requires gpu build
step bench 120 "$b"/bench/infkv_bench_cuda --benchmark_out="$logs/bench_cuda.json" --benchmark_out_format=json \
  --benchmark_min_time=0.01 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
requires gpu build
step gpu_tests 90 "${gpu[@]}" "$b"/tests/infkv_gpu_tests --duration=true
# One Nsight Compute CSV of the reference eviction's kernels at 131,072 slots (window scoring, the
# selection, pooling, compaction): per kernel its time, DRAM bytes, SM throughput and grid, for
# docs/performance.md section 7's model to be compared with.
requires gpu build ncu
step ncu 60 "$ncu" --csv --log-file "$out/ncu.csv" --launch-count 40 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic \
  "$b"/bench/infkv_bench_cuda --benchmark_filter='BM_(window_scoring|topk|pool|compact)/131072$' --benchmark_min_time=0.001
requires build  # the library built here against the stub runtime: runs without a GPU too
step nosync 30 "$b"/tests/infkv_nosync_tests
requires gpu build
step example 20 "${gpu[@]}" "$b"/examples/infkv-example-cuda-paged 8192
requires gpu build sanitizer
step memcheck 75 "${small[@]}" "${san[@]}" --tool memcheck "$b"/tests/infkv_gpu_tests
requires gpu build sanitizer  # shared-memory hazards of the block-level kernels (fused window attention, KeyDiff)
step racecheck 45 "${small[@]}" "${san[@]}" --tool racecheck --racecheck-report hazard "$b"/tests/infkv_gpu_tests
requires gpu build sanitizer
step initcheck 75 "${small[@]}" "${san[@]}" --tool initcheck "$b"/tests/infkv_gpu_tests
requires gpu build sanitizer
step synccheck 45 "${small[@]}" "${san[@]}" --tool synccheck "$b"/tests/infkv_gpu_tests
finish "$failed"
