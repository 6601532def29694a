#!/bin/bash
# Time of `pip install ray==2.60.0` (no pip cache: download + install) into a fresh venv that already has numpy
set -e
D=$(mktemp -d)
python3 -m venv $D/venv
$D/venv/bin/python -m pip install -q --no-cache-dir numpy==2.4.6 >/dev/null
s=$(date +%s.%N)
$D/venv/bin/python -m pip install -q --no-cache-dir "ray==2.60.0"
e=$(date +%s.%N)
echo "ray_install_seconds $(echo "$e - $s" | bc)"
du -sh $D/venv/lib/python3*/site-packages/ray | tail -1
rm -rf $D
