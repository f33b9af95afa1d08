#!/usr/bin/env bash
# The soak: TOKENS (default 10M) synthetic tokens through the core for every evicting policy
# (infkv-soak), then a plot of RSS and eviction time against tokens. Writes OUT_DIR/soak.csv,
# soak.json and soak.png (default bench/results/soak). Run on an idle machine: a few minutes per
# million tokens over all policies on one core.
#   scripts/soak.sh [TOKENS] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens=${1:-10000000}
out=${2:-bench/results/soak}
mkdir -p "$out"
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target infkv_soak
build/release/examples/infkv-soak --tokens "$tokens" --csv "$out/soak.csv" --json "$out/soak.json" --sample-every 256 | tee "$out/soak.txt"
python3 - "$out" <<'PY'
import csv, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/soak.csv")))
policies = list(dict.fromkeys(r["policy"] for r in rows))
fig, (a, b) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
for p in policies:
    x = [int(r["tokens"]) / 1e6 for r in rows if r["policy"] == p]
    a.plot(x, [int(r["rss_bytes"]) / 2**20 for r in rows if r["policy"] == p], label=p)
    b.plot(x, [float(r["evict_us"]) for r in rows if r["policy"] == p], label=p, linewidth=0.6)
a.set_ylabel("process RSS (MiB)")
b.set_ylabel("eviction time (us, one sample)")
b.set_yscale("log")
b.set_xlabel("tokens streamed (millions)")
a.legend(ncol=4, fontsize=8)
a.set_title("infkv-soak: budget 1024, block 128, 2 KV heads x 3, d 64, f16 (one process, policies in turn)")
fig.tight_layout()
fig.savefig(f"{out}/soak.png", dpi=110)
print(f"soak: {out}/soak.png")
PY
