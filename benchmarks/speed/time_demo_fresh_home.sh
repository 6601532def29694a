#!/usr/bin/env bash
# idle-core timing of memlm demo on a fresh home (full, then --quick), one argument: the tag of the log files (default session39)
set -u
cd /work/main
export HF_HUB_OFFLINE=1
for mode in full quick; do
  while :; do l=$(cut -d' ' -f1 /proc/loadavg); python3 -c "import sys; sys.exit(0 if $l < 0.3 else 1)" && break; sleep 10; done
  home=/tmp/demohome_$mode; rm -rf $home; mkdir -p $home
  out=docs/results/demo_${mode}_fresh_home_${1:-session39}.log
  flag=""; [ $mode = quick ] && flag="--quick"
  { echo "command: cd /tmp && MEMLM_HOME=$home (empty) HF_HUB_OFFLINE=1 memlm demo $flag (commit $(git rev-parse --short HEAD)); first line /proc/loadavg before, last after, then wall seconds"
    cat /proc/loadavg
    s=$(date +%s.%N)
    (cd /tmp && MEMLM_HOME=$home /work/main/.venv/bin/memlm demo $flag 2>&1 | tr '\r' '\n' | grep -v '%|' )
    e=$(date +%s.%N)
    cat /proc/loadavg
    python3 -c "print('wall_s', round($e - $s, 1))"; } > $out 2>&1
done
