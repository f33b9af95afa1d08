#!/usr/bin/env bash
# Installs what infkv's build, tests, examples and benchmarks need, from Debian's packages.
# Idempotent: does nothing when everything is already installed. ffmpeg (its ffmpeg and ffprobe
# programs): llama.cpp's mtmd reads video frames through them (infkv-video and its tests).
set -euo pipefail
packages=(cmake ninja-build g++ python3 python3-dev python3-venv python3-numpy python3-pip doctest-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev libfmt-dev libopenblas-dev pkg-config clang clang-format gnuplot-nox ffmpeg)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "infkv setup: installing ${missing[*]}" >&2
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
