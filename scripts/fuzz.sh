#!/usr/bin/env bash
# Builds infkv's libFuzzer targets (fuzz/*.cpp) with clang, ASan and UBSan into build/fuzz and
# runs each for SECONDS (default 30) from its committed seed corpus (fuzz/corpus/<target>), new
# inputs going to build/fuzz/corpus/<target>. Prints each target's executions, coverage and
# features; a crash or a violated property stops with its input saved in build/fuzz/crashes.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
shift || true
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cxx" ]; then
  echo "fuzz: clang++ not found (scripts/setup.sh installs clang)" >&2
  exit 1
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(views runs select compact trace)
out=build/fuzz
mkdir -p "$out/crashes"
flags=(-std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Iinclude -Ibackends/cpu/include
       -Ibackends/cuda/include -Itests -Itools/common -Ifuzz)
status=0
for t in "${targets[@]}"; do
  src=fuzz/fuzz_$t.cpp bin=$out/fuzz_$t
  if [ ! -x "$bin" ] || [ -n "$(find "$src" fuzz/input.hpp include backends tools/common -newer "$bin" -print -quit)" ]; then
    echo "fuzz: building $t" >&2
    # shellcheck disable=SC2046  # pkg-config's words are separate flags
    "$cxx" "${flags[@]}" $(pkg-config --cflags openblas) "$src" -o "$bin" -lfmt -lpthread $(pkg-config --libs openblas)
  fi
  mkdir -p "$out/corpus/$t" "fuzz/corpus/$t"
  log=$out/fuzz_$t.log
  if "$bin" -max_total_time="$seconds" -print_final_stats=1 -timeout=20 -rss_limit_mb=4096 \
       -artifact_prefix="$out/crashes/${t}-" "$out/corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1; then
    runs=$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo ?)
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -n 1 || echo '?')
    # Plateau: the execution at which coverage (edges) last grew.
    last_cov=$(grep -E '^#[0-9]+.*NEW.*cov: ' "$log" | awk '{c=$0; sub(/.*cov: /,"",c); split(c,a," "); if (a[1]!=prev) {n=$1; prev=a[1]}} END {print n}' || true)
    echo "fuzz $t: ${seconds}s, $runs executions, $cov, edges last grew at ${last_cov:-#0}" >&2
  else
    echo "fuzz $t: FAILED (input saved in $out/crashes/${t}-*); log:" >&2
    grep -E 'ERROR|violated|SUMMARY|runtime error|==[0-9]+==' "$log" | head -n 15 >&2 || tail -n 30 "$log" >&2
    status=1
  fi
done
exit $status
