"""Two `memlm datastore build` processes started together into one folder, N times: who wins, what the other says,
and whether the folder ends up equal to a lone build.

    PYTHONPATH=src .venv/bin/python benchmarks/reliability/concurrent_builds.py --trials 5 \
        --out docs/results/reliability/concurrent_builds.json

``--src`` picks the memlm source tree to test (default: this checkout's ``src``), so the same trials can be run
against an older commit. The model is the tests' tiny random GPT-2 (saved once into a temporary folder), the corpus 60
toy documents; both processes are started back to back and run the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

FILES = ("keys.bin", "values.bin", "doc_hash.bin", "offset.bin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--src", default=str(ROOT / "src"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from conftest import gpt2_tokenizer, make_toy_docs, tiny_gpt2

    work = Path(tempfile.mkdtemp(prefix="memlm-concurrency-"))
    model_dir = work / "model"
    tiny_gpt2(0).save_pretrained(model_dir)
    gpt2_tokenizer().save_pretrained(model_dir)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in make_toy_docs(60)))
    env = {**os.environ, "PYTHONPATH": args.src, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def cmd(out: Path) -> list[str]:
        return [sys.executable, "-m", "memlm.cli", "datastore", "build", "--model", str(model_dir), "--corpus",
                str(corpus), "--out", str(out), "--window", "32", "--min-context", "8", "--batch-size", "1",
                "--no-index"]  # fmt: skip

    lone = work / "lone"
    subprocess.run(cmd(lone), env=env, check=True, capture_output=True)
    ref = {f: (lone / f).read_bytes() for f in FILES}

    trials = []
    for t in range(args.trials):
        out = work / f"trial{t}"
        t0 = time.perf_counter()
        procs = [subprocess.Popen(cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]  # fmt: skip
        res = [p.communicate() for p in procs]
        codes = [p.returncode for p in procs]
        errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, err in res]
        tracebacks = sum("Traceback" in err for _, err in res)
        equal = all((out / f).exists() and (out / f).read_bytes() == ref[f] for f in FILES)
        opens = subprocess.run([sys.executable, "-m", "memlm.cli", "datastore", "info", str(out), "--verify"],
                               env=env, capture_output=True, text=True)  # fmt: skip
        refused = [i for i, c in enumerate(codes) if c == 2]
        names_holder = bool(refused) and all(
            f"pid {procs[1 - i].pid}" in " ".join(errors[i]) for i in refused if len(refused) == 1
        )
        trials.append({
            "exit_codes": codes,
            "error_lines": errors,
            "tracebacks": tracebacks,
            "refusal_names_holder_pid": names_holder,
            "result_equals_lone_build": equal,
            "verify_exit_code": opens.returncode,
            "seconds": round(time.perf_counter() - t0, 2),
        })  # fmt: skip
        print(json.dumps(trials[-1]), flush=True)

    summary = {
        "trials": len(trials),
        "one_refused_exit_2": sum(sorted(t["exit_codes"]) == [0, 2] for t in trials),
        "both_exit_0": sum(t["exit_codes"] == [0, 0] for t in trials),
        "refusal_names_holder_pid": sum(t["refusal_names_holder_pid"] for t in trials),
        "result_equals_lone_build": sum(t["result_equals_lone_build"] for t in trials),
        "verify_ok": sum(t["verify_exit_code"] == 0 for t in trials),
        "tracebacks": sum(t["tracebacks"] for t in trials),
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    src = Path(args.src).resolve()
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out_path.write_text(json.dumps({"src": str(src), "commit": commit.stdout.strip(), "summary": summary,
                                    "trials": trials}, indent=2) + "\n")  # fmt: skip
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
