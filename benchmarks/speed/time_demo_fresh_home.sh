#!/usr/bin/env bash
# Timing of `memlm demo` on a fresh home (full, then --quick), from the repository root, with `memlm` on PATH.
# Arguments: the tag of the files, docs/results/demo_{full,quick}_fresh_home_TAG.log and the full run's
# docs/results/demo_full_fresh_home_TAG_results.json (e.g. the CPU kind); then, optionally, the seconds to wait for an
# idle machine (default 900) and `busy-ok` to time it anyway when it stays busy (the log records the load: not a
# benchmark then). MODES (default "full quick") picks the modes; NICE (e.g. -20, as root) runs the demo at that
# priority, so that on a busy machine it takes the cores first (memory and cache are still shared; the log says so).
# Each log: the command, `uptime` and /proc/loadavg before, the machine (protocol.host()) and the
# `lscpu` flags line, the demo's output, `/usr/bin/time -v` of it, /proc/loadavg after, wall seconds, then a
# rerun's wall seconds.
set -u
cd "$(dirname "$0")/../.."
tag=${1:?usage: time_demo_fresh_home.sh TAG [WAIT_S] [busy-ok]}
wait_s=${2:-900}
busy=${3:-}
export HF_HUB_OFFLINE=1
for mode in ${MODES:-full quick}; do
  # the timing protocol's idle check (benchmarks/protocol.py: <= 5% of the CPU busy over 5 s and a 1-minute load under
  # 0.3), waiting up to wait_s for it; a busy machine stops the script unless busy-ok
  force=False; [ "$busy" = busy-ok ] && force=True
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import protocol; protocol.idle_check($force, $wait_s)" || exit 1
  home=$(mktemp -d); work=$(mktemp -d)
  out=$PWD/docs/results/demo_${mode}_fresh_home_${tag}.log
  flag=""; [ $mode = quick ] && flag="--quick"
  run="/usr/bin/time -v memlm demo $flag"; [ -n "${NICE:-}" ] && run="nice -n $NICE $run"
  { echo "command: MEMLM_HOME=(empty) HF_HUB_OFFLINE=1 $run (commit $(git rev-parse --short HEAD)); then uptime and /proc/loadavg before, the machine (protocol.host()), the lscpu flags line, the demo's output, /usr/bin/time -v, /proc/loadavg after, wall seconds"
    uptime
    cat /proc/loadavg
    python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); import protocol; print('machine', json.dumps(protocol.host()))"
    lscpu | grep '^Flags'
    s=$(date +%s.%N)
    (cd "$work" && MEMLM_HOME=$home $run 2>&1 | tr '\r' '\n' | grep -v '%|' )
    e=$(date +%s.%N)
    cat /proc/loadavg
    python3 -c "print('wall_s', round($e - $s, 1))"
    # a second run in the same home reuses what the first built (memories, calibrations, dumps): no forward pass
    s=$(date +%s.%N)
    (cd "$work" && MEMLM_HOME=$home memlm demo $flag > /dev/null 2>&1)
    e=$(date +%s.%N)
    python3 -c "print('rerun_wall_s', round($e - $s, 1))"; } > "$out" 2>&1
  if [ $mode = full ]; then
    cp "$home"/demo/full-*/results.json "$PWD/docs/results/demo_full_fresh_home_${tag}_results.json"
    cp "$home"/demo/full-*/ppl_vs_lambda.png "$PWD/docs/results/demo_ppl_vs_lambda.png"
  fi
  rm -rf "$home" "$work"
done
