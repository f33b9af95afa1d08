#!/usr/bin/env bash
# The bounded load test of `vllm serve` with infkv's plugin (load.py): CLIENTS (16) multi-turn chats
# of TURNS (100) turns over loopback, each client resending at most 2,400 characters of history (its
# oldest exchanges dropped first), every request evicting; writes bench/results/vllm/load.json
# (latencies, the server's RSS every second, errors) with provenance. Outside CI: about an hour on
# one core at 100 turns.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/vllm_common.sh
out=bench/results/vllm
mkdir -p "$out"
clients=${CLIENTS:-16} turns=${TURNS:-100}
cmd="CLIENTS=$clients TURNS=$turns bench/vllm/load.sh"
(cd /tmp && "$env/bin/python" "$OLDPWD/bench/vllm/load.py" --model "$model" --text "$text" --clients "$clients" \
  --turns "$turns" --out "$OLDPWD/$out/load.json")
rm -f "$out/load.json.stats" "$out/load.json.stats.tmp"
mv "$out/load.json.log" /tmp/infkv_vllm_load_server.log
python3 scripts/provenance.py "$out/load.json" "$cmd"
