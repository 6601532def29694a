"""kill -9 at random moments during `memlm datastore build` and `memlm index build`, then rerun: byte-identical?

Usage (tiny random GPT-2 from tests/conftest.py, a toy corpus; about 20 s per trial on 2 busy cores):

    PYTHONPATH=src python benchmarks/reliability/kill_campaign.py --trials 8 --seed 0 \
        --out docs/results/reliability/kill_campaign.json

Each trial: start the command, SIGKILL it after a delay drawn uniformly from [0, the uninterrupted run's wall time],
record how far it got (progress.json's windows_done, or whether the index existed), rerun the same command, and
compare with the uninterrupted reference: the datastore's full SHA-256 (``Datastore.checksum`` after
``open(verify=True)``) and the index file's bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "memlm.cli", *args]


def build_cmd(model: Path, corpus: Path, out: Path) -> list[str]:
    return cli("datastore", "build", "--model", str(model), "--corpus", str(corpus), "--out", str(out),
               "--window", "16", "--min-context", "4", "--batch-size", "1", "--no-index")  # fmt: skip


def index_cmd(ds: Path) -> list[str]:
    return cli("index", "build", str(ds), "--factory", "IVF8,Flat", "--metric", "l2")


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=ENV, check=True, capture_output=True)
    return time.perf_counter() - t0


def killed_at(cmd: list[str], delay: float) -> float:
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.perf_counter()
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return time.perf_counter() - t0


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    from conftest import gpt2_tokenizer, make_toy_docs, tiny_gpt2

    from memlm.storage.datastore import Datastore

    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="memlm-kill-"))
    model = tmp / "model"
    tiny_gpt2(0).save_pretrained(model)
    gpt2_tokenizer().save_pretrained(model)
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(40)))

    ref = tmp / "ref"
    t_build = timed(build_cmd(model, corpus, ref))
    t_index = timed(index_cmd(ref))
    ref_sum = Datastore.open(ref, verify=True).checksum()
    ref_index = sha(ref / "index.faiss")
    rows = []
    for trial in range(a.trials):
        for kind in ("datastore build", "index build"):
            out = tmp / f"t{trial}"
            if kind == "datastore build":
                delay = rng.uniform(0, t_build)
                ran = killed_at(build_cmd(model, corpus, out), delay)
                progress = out / "progress.json"
                state = "finished" if (out / "manifest.json").exists() and not progress.exists() else "interrupted"
                done = json.loads(progress.read_text())["windows_done"] if progress.exists() else None
                rerun = subprocess.run(build_cmd(model, corpus, out), env=ENV, capture_output=True, text=True)
                ok = rerun.returncode == 0 and Datastore.open(out, verify=True).checksum() == ref_sum
            else:
                delay = rng.uniform(0, t_index)
                ran = killed_at(index_cmd(out), delay)
                state = "finished" if (out / "index.faiss").exists() else "interrupted"
                done = None
                rerun = subprocess.run(index_cmd(out), env=ENV, capture_output=True, text=True)
                ok = rerun.returncode == 0 and sha(out / "index.faiss") == ref_index
            row = {"trial": trial, "command": kind, "kill_after_s": round(delay, 3), "ran_s": round(ran, 3),
                   "state_at_kill": state, "windows_done_at_kill": done, "rerun_exit": rerun.returncode,
                   "identical": ok, "rerun_error": [] if ok else rerun.stderr.strip().splitlines()[-1:]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {
        kind: {"trials": sum(r["command"] == kind for r in rows),
               "identical": sum(r["identical"] for r in rows if r["command"] == kind),
               "killed_mid_run": sum(r["state_at_kill"] == "interrupted" for r in rows if r["command"] == kind)}
        for kind in ("datastore build", "index build")
    }  # fmt: skip
    result = {
        "command": " ".join(["python", "benchmarks/reliability/kill_campaign.py", *sys.argv[1:]]),
        "seed": a.seed,
        "reference_seconds": {"datastore build": round(t_build, 2), "index build": round(t_index, 2)},
        "summary": summary,
        "trials": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
