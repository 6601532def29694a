#!/usr/bin/env bash
# Idle-core timing of `memlm demo` on a fresh home (full, then --quick), from the repository root, with `memlm` on PATH.
# One argument: the tag of the log files, docs/results/demo_{full,quick}_fresh_home_TAG.log (e.g. the CPU kind).
set -u
cd "$(dirname "$0")/../.."
tag=${1:?usage: time_demo_fresh_home.sh TAG}
export HF_HUB_OFFLINE=1
for mode in full quick; do
  # the timing protocol's idle check (benchmarks/protocol.py: <= 5% of the CPU busy over 5 s and a 1-minute load under
  # 0.3), waiting up to 15 minutes for it; a busy machine stops the script
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import protocol; protocol.idle_check(False, 900)" || exit 1
  home=$(mktemp -d); work=$(mktemp -d)
  out=$PWD/docs/results/demo_${mode}_fresh_home_${tag}.log
  flag=""; [ $mode = quick ] && flag="--quick"
  { echo "command: MEMLM_HOME=(empty) HF_HUB_OFFLINE=1 memlm demo $flag (commit $(git rev-parse --short HEAD)); first line /proc/loadavg before, then the machine (protocol.host()), last /proc/loadavg after, then wall seconds"
    cat /proc/loadavg
    python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); import protocol; print('machine', json.dumps(protocol.host()))"
    s=$(date +%s.%N)
    (cd "$work" && MEMLM_HOME=$home memlm demo $flag 2>&1 | tr '\r' '\n' | grep -v '%|' )
    e=$(date +%s.%N)
    cat /proc/loadavg
    python3 -c "print('wall_s', round($e - $s, 1))"; } > "$out" 2>&1
  rm -rf "$home" "$work"
done
