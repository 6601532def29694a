#!/usr/bin/env bash
# Idle-core timing of `memlm demo` on a fresh home (full, then --quick), from the repository root, with `memlm` on PATH.
# One argument: the tag of the log files, docs/results/demo_{full,quick}_fresh_home_TAG.log (e.g. the CPU kind).
set -u
cd "$(dirname "$0")/../.."
tag=${1:?usage: time_demo_fresh_home.sh TAG}
export HF_HUB_OFFLINE=1
for mode in full quick; do
  while :; do l=$(cut -d' ' -f1 /proc/loadavg); python3 -c "import sys; sys.exit(0 if $l < 0.3 else 1)" && break; sleep 10; done
  home=$(mktemp -d); work=$(mktemp -d)
  out=$PWD/docs/results/demo_${mode}_fresh_home_${tag}.log
  flag=""; [ $mode = quick ] && flag="--quick"
  { echo "command: MEMLM_HOME=(empty) HF_HUB_OFFLINE=1 memlm demo $flag (commit $(git rev-parse --short HEAD)); first line /proc/loadavg before, last after, then wall seconds"
    cat /proc/loadavg
    s=$(date +%s.%N)
    (cd "$work" && MEMLM_HOME=$home memlm demo $flag 2>&1 | tr '\r' '\n' | grep -v '%|' )
    e=$(date +%s.%N)
    cat /proc/loadavg
    python3 -c "print('wall_s', round($e - $s, 1))"; } > "$out" 2>&1
  rm -rf "$home" "$work"
done
