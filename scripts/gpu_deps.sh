#!/usr/bin/env bash
# Copies the Debian development packages the GPU build needs (doctest, Google Benchmark, fmt,
# CLI11, nlohmann-json) into build/gpu-deps, so that a GPU machine without them (or without a
# network) can build the tests and benchmarks: carry build/gpu-deps with the working tree and run
# scripts/gpu_check.sh there. Run on a build machine after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=build/gpu-deps
rm -rf "$dest" && mkdir -p "$dest"
for pkg in doctest-dev libbenchmark-dev libbenchmark1debian libfmt-dev libfmt9 libcli11-dev nlohmann-json3-dev; do
  dpkg-query -W "$pkg" >/dev/null 2>&1 || { echo "gpu_deps: $pkg is not installed (run scripts/setup.sh)" >&2; exit 1; }
  dpkg -L "$pkg" | while read -r f; do
    case "$f" in /usr/include/*|/usr/lib/*|/usr/share/*cmake*) ;; *) continue ;; esac
    if [ -f "$f" ] || [ -L "$f" ]; then mkdir -p "$dest$(dirname "$f")" && cp -P "$f" "$dest$f"; fi
  done
done
du -sh "$dest" >&2
echo "$PWD/$dest/usr"
