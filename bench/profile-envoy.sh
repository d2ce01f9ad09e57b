#!/usr/bin/env bash
# Where a side's Envoy CPU goes: run filter-bench with each timed run's window printed
# (IDEM_BENCH_WINDOWS=1), record every Envoy it starts with `perf record` (cpu-clock, DWARF call
# graphs: the pinned Envoy is stripped but keeps .eh_frame, so stacks unwind through it), then
# split each window's samples by where they ran (bench/split-profile.py): the filter's own code,
# Envoy working for the filter's calls, Envoy's own work, the kernel. docs/performance.md quotes
# its tables. Needs `perf` (Debian linux-perf) and a built tree (`make build`, release binaries).
#
#   bench/profile-envoy.sh target/bench/profile --cases proxy --seconds 3 --reps 1
set -euo pipefail
out=${1:?usage: bench/profile-envoy.sh OUT-DIR [filter-bench args...]}
shift
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "perf not found (apt-get install linux-perf)"; exit 2; }
mkdir -p "$out"
freq=${PROFILE_FREQ:-499}

IDEM_BENCH_WINDOWS=1 IDEM_E2E_PROFILE=release ./target/release/filter-bench "$@" >"$out/bench.log" 2>&1 &
bench=$!
declare -A seen=()
recorders=()
# filter-bench starts one Envoy per store stack: record each as it appears.
while kill -0 "$bench" 2>/dev/null; do
  for pid in $(pgrep -x envoy -P "$bench" 2>/dev/null || true); do
    [[ -n "${seen[$pid]:-}" ]] && continue
    seen[$pid]=1
    perf record -q -k CLOCK_REALTIME -F "$freq" --call-graph dwarf,32768 -p "$pid" \
      -o "$out/envoy-$pid.perf.data" >"$out/envoy-$pid.perf.log" 2>&1 &
    recorders+=($!)
  done
  sleep 0.2
done
wait "$bench" || { tail -20 "$out/bench.log"; exit 1; }
for r in "${recorders[@]}"; do kill -INT "$r" 2>/dev/null || true; wait "$r" 2>/dev/null || true; done
python3 bench/split-profile.py --freq "$freq" "$out"
