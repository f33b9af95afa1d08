#!/usr/bin/env bash
# Formats the project's C++ files with .clang-format (clang-format 14, from Debian's packages):
# every tracked .hpp / .cpp / .cu / .cuh file, or the FILES given. With --check nothing is
# changed: it lists the files that do not follow the style and exits 1 (scripts/test.sh runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
if [ "${1:-}" = --check ]; then check=1; shift; fi
command -v clang-format >/dev/null || scripts/setup.sh
files=("$@")
if [ ${#files[@]} -eq 0 ]; then mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh'); fi
if [ $check -eq 0 ]; then
  clang-format -i --style=file "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format: ${#bad[@]} file(s) do not follow .clang-format (scripts/format.sh FILE fixes them):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "format: ${#files[@]} files follow .clang-format" >&2
