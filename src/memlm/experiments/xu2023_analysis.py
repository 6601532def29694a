"""The ablation grid of Xu, Alon, Neubig (2023), "Why do Nearest Neighbor Language Models Work?", on any model.

Every experiment is one setting of their Eq. 5::

    P = (1-λ) softmax(W_sm h_sm) + λ M softmax(mask-to-k(W_ds ⊗ h_ds) / τ)

* Table 1: h_ds ∈ {att (``ffn_in``: the last FFN's input after its layer norm), ffn (``final``: what the softmax
  reads)} x ⊗ ∈ {L2, IP}, with an approximate FAISS index (mask and scores from FAISS).
* Table 2 / Fig. 3 (their §4.1-4.2, App. B): W_ds a *learned* nV x D matrix fed by att or ffn
  (:class:`memlm.xu2023.generalized.LearnedWds`), trained with cross-entropy on the datastore's own (key, value)
  pairs, i.e. the frozen LM's h_ds at its training positions; n embeddings per word, summed by M.
* Table 3 / Fig. 2 and 4: FAISS mask + FAISS score, FAISS mask + real score, real mask + real score (exact search),
  on random subsamples of the datastore.
* Fig. 5: the temperature τ from 0.1 to 3.0 (and on to 10), for the 5% and the full datastore; the "best τ" is the
  one with the lowest *valid* perplexity.

λ (and τ, outside Fig. 5) is tuned on the validation split per setting and applied to test. The paper's Tables 1 and 3
are at τ = 1, so every Table 1 / Table 3 row also carries ``tau1``: the same row with τ = 1 and only λ tuned on valid
(the like-for-like comparison with the paper's numbers). Every row also has the
memory-only perplexity ("PPL", ∞ when some target is never retrieved) and the oracle perplexity (the best λ ∈ {0, 1}
per token). One forward pass per split is kept (LM log-probabilities and h_ds queries) and each retrieval is kept as a
per-token dump, so rerunning resumes and re-tuning never searches again.

Files under ``out``: ``forward-<split>.npz`` + ``queries-<split>-<role>.npy``; ``nb/*.npz`` neighbour dumps;
``ds/`` subsampled datastores; ``learned/*.pt``; ``analysis.json`` (every number), ``tables.md`` (Tables 1-3 and the
n-sweep, with the paper's numbers beside ours) and ``fig_datastore_ratio.png`` (Fig. 2/4), ``fig_learned_n.png``
(Fig. 3), ``fig_temperature.png`` (Fig. 5).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.core.distribution import mix, perplexity
from memlm.core.tuning import DEFAULT_LAMBDAS, DEFAULT_TEMPERATURES, grid_search
from memlm.errors import MemlmError, option
from memlm.io.fileio import atomic_write_json, dumps_json, unique_tmp
from memlm.knnlm.evaluate import add_neighbours, perplexities
from memlm.knnlm.table import TokenTable
from memlm.storage import index as index_lib
from memlm.storage.datastore import Datastore

__all__ = ["AnalysisSpec", "PAPER", "approx_factory", "interpolation_row", "run_analysis", "write_report"]

ROLES = {"att": "ffn_in", "ffn": "final"}  # Xu et al.'s names -> memlm key roles
# 0.1..3.0 as the paper's Fig. 5, then wider: the scratch LM's best τ sat at the 3.0 edge
FIG5_TEMPERATURES = tuple(round(0.1 * i, 1) for i in range(1, 31)) + (3.5, 4.0, 5.0, 6.0, 8.0, 10.0)
SETTINGS = {  # Table 3 rows: (mask, score) -> (search, scores) of memlm.knnlm.evaluate.retrieve
    "FAISS mask, FAISS score": ("index", "index"),
    "FAISS mask, real score": ("index", "exact"),
    "real mask, real score": ("exact", "exact"),
}

# The paper's numbers (Wikitext-103, their 268M-parameter LM, 150M-entry datastore), for the side-by-side tables.
PAPER: dict[str, Any] = {
    "base": 21.750,
    "table1": {  # (h_ds, sim) -> (interp ppl, oracle)
        ("att", "l2"): (19.174, 14.230),
        ("att", "ip"): (19.095, 14.077),
        ("ffn", "l2"): (20.734, 15.594),
        ("ffn", "ip"): (21.101, 16.254),
    },
    "learned": {  # (h_ds, n) -> (ppl alone, interp ppl, oracle)   Tables 2 and 5
        ("att", 1): (22.584, 20.353, 16.954),
        ("att", 2): (21.903, 20.529, 17.432),
        ("att", 3): (22.434, 20.395, 17.132),
        ("att", 4): (21.936, 20.521, 17.423),
        ("att", 5): (22.025, 20.643, 17.560),
        ("att", 6): (21.972, 20.519, 17.422),
        ("att", 9): (22.084, 20.696, 17.631),
        ("ffn", 1): (20.920, 20.694, 18.772),
        ("ffn", 2): (20.889, 20.646, 18.701),
        ("ffn", 3): (20.829, 20.603, 18.717),
        ("ffn", 4): (20.769, 20.629, 18.876),
        ("ffn", 5): (20.720, 20.594, 18.878),
        ("ffn", 6): (20.726, 20.599, 18.902),
        ("ffn", 9): (20.687, 20.567, 18.887),
    },
    "table3": {  # setting -> (λ, interp ppl, oracle), att + L2, full datastore
        "FAISS mask, FAISS score": (0.271, 19.174, 14.230),
        "FAISS mask, real score": (0.176, 19.672, 14.393),
        "real mask, real score": (0.172, 19.735, 14.480),
    },
}


@dataclass
class AnalysisSpec:
    """What to analyse: a model, its datastores per h_ds role, the held-out text and the grid."""

    model: str
    datastores: dict[str, str]  # "att" and/or "ffn" -> datastore folder (built by ``memlm datastore build``)
    valid: str = "wiki"  # corpora (comma-separated), split valid
    test: str = "wiki"  # corpora (comma-separated), split test
    max_tokens: int | None = None  # per split: leading documents up to this many tokens, shared among the corpora
    window: int = 512
    min_context: int = 128
    batch_size: int = 4
    dtype: str = "bfloat16"
    k: int = 1024
    nprobe: int = 32
    factory: str | None = None  # approximate index; default approx_factory(n, d)
    fractions: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    temperatures: tuple[float, ...] = FIG5_TEMPERATURES
    learned_n: tuple[int, ...] = (1, 2, 3, 6)
    learned_steps: int = 1000
    learned_batch: int = 512
    learned_lr: float = 1e-3
    # None: train each W_ds for learned_steps updates (at most one epoch). P: train until its memory-only loss on the
    # valid text has not improved for P log points (every learned_log_every updates), learned_steps being the most
    learned_patience: int | None = None
    learned_log_every: int = 100
    seed: int = 0
    skip: tuple[str, ...] = ()  # any of ANALYSIS_PARTS: table1, approx, temperature, learned

    def tune_temperatures(self) -> tuple[float, ...]:
        return tuple(sorted(set(DEFAULT_TEMPERATURES) | set(self.temperatures)))


def approx_factory(n: int, d: int) -> str:
    """An IVF-PQ factory like Khandelwal et al.'s ``IVF4096,PQ64`` (16 dims per sub-quantizer, 8-bit codes), with
    about 2 sqrt(n) inverted lists (a power of two, at most 4096).

    Its scores are approximate (PQ), so "FAISS score" differs from "real score" as in Xu et al. §5.1.
    """
    m = max(1, d // 16)
    while d % m:
        m -= 1
    nlist = min(4096, 2 ** int(math.log2(max(2.0, 2 * math.sqrt(n)))))  # ~2 sqrt(n) lists, a power of two
    return f"IVF{nlist},PQ{m}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text)


def _settings_key(settings: dict[str, Any]) -> str:
    """A short hash of the settings that produced a cached file, for its name."""
    return hashlib.sha256(dumps_json(settings, indent=None).encode()).hexdigest()[:10]


def _ds_identity(ds: Datastore) -> dict[str, Any]:
    """What identifies a datastore's contents: its folder, size and the checksum of its keys and values."""
    files = ds.manifest.get("files", {})
    return {
        "path": str(ds.path),
        "count": len(ds),
        "keys": files.get("keys", {}).get("sha256"),
        "values": files.get("values", {}).get("sha256"),
    }


def interpolation_row(
    valid_lm: torch.Tensor,
    valid_mem: torch.Tensor,
    test_lm: torch.Tensor,
    test_mem: torch.Tensor,
    lambdas: Sequence[float] = DEFAULT_LAMBDAS,
) -> dict[str, Any]:
    """λ tuned on valid for ``(1-λ) p_LM + λ p_mem`` (log-probabilities of the targets), then test perplexities.

    Used for memories that come as target log-probabilities (the learned W_ds); datastore dumps go through
    :func:`memlm.mixing.report.fit_table`, which fits λ by EM and chooses τ.
    """
    tuned = grid_search(lambda lam: perplexity(mix([valid_lm, valid_mem], weights=[1 - lam, lam])), {"lam": lambdas})
    tuned = tuned["best"]
    best = tuned["lam"]
    return {
        "lambda": best,
        "valid_ppl": tuned["ppl"],
        "base_ppl": perplexity(test_lm),
        "memory_ppl": perplexity(test_mem),
        "interp_ppl": perplexity(mix([test_lm, test_mem], weights=[1 - best, best])),
        "oracle_ppl": perplexity(torch.maximum(test_lm, test_mem)),
    }


def _dump_row(valid: TokenTable, test: TokenTable, temperatures: Sequence[float], k: int) -> dict[str, Any]:
    """λ (by EM) and τ (the most likely of ``temperatures``) fitted on the valid dump, applied to the test dump."""
    from memlm.mixing.report import fit_summary, fit_table

    best = fit_summary(fit_table(valid, "rule", temperatures, k))
    res = perplexities(test, lam=best["knn"], temperature=best["temperature"], k=k)
    return {
        "lambda": best["knn"],
        "temperature": best["temperature"],
        "valid_ppl": best["ppl"],
        "base_ppl": res["base_ppl"],
        "memory_ppl": res["knn_only_ppl"],
        "interp_ppl": res["knn_ppl"],
        "oracle_ppl": res["oracle_ppl"],
        "target_in_neighbours": res["target_in_neighbours"],
    }


class _Run:
    """State of one analysis: lazily loaded model, cached forward passes and dumps."""

    def __init__(self, spec: AnalysisSpec, out: Path, progress: bool, log: Callable[[str], None]):
        self.spec, self.out, self.progress, self.log = spec, out, progress, log
        self._model = None
        self.datastores = {}
        for role, folder in spec.datastores.items():
            if role not in ROLES:
                raise MemlmError(f"unknown h_ds role {role!r}: use att (ffn_in keys) or ffn (final keys)")
            ds = Datastore.open(folder)
            if ds.key_spec.role != ROLES[role]:
                raise MemlmError(
                    f"datastore {folder} holds {ds.key_spec.describe()} keys, but '{role}' needs {ROLES[role]} keys: "
                    f"build it with --key {ROLES[role]}"
                )
            self.datastores[role] = ds
        if not self.datastores:
            raise MemlmError("give at least one datastore (att: ffn_in keys, ffn: final keys)")
        first = next(iter(self.datastores.values()))
        for ds in self.datastores.values():
            if ds.manifest["model"]["fingerprint"] != first.manifest["model"]["fingerprint"]:
                raise MemlmError(f"datastores {first.path} and {ds.path} were built with different models")

    # -- model and forward passes ------------------------------------------------------------------------------
    def model(self):
        if self._model is None:
            from memlm.models.resources import load_causal_lm

            model, tok = load_causal_lm(self.spec.model, dtype=self.spec.dtype)
            for ds in self.datastores.values():
                ds.check_compatible(model, tok)
            self._model = (model, tok)
        return self._model

    def forward(self, split: str) -> tuple[TokenTable, dict[str, np.ndarray]]:
        """LM scores and the queries of every role for the valid or test split (cached)."""
        dump = self.out / f"forward-{split}.npz"
        qpaths = {role: self.out / f"queries-{split}-{role}.npy" for role in self.datastores}
        if not (dump.exists() and all(p.exists() for p in qpaths.values())):
            from memlm.data.corpora import load_corpora
            from memlm.data.windows import limit_documents
            from memlm.knnlm.evaluate import lm_scores

            model, tok = self.model()
            corpora = self.spec.valid if split == "valid" else self.spec.test
            names = [c.strip() for c in corpora.split(",") if c.strip()]
            share = None if self.spec.max_tokens is None else max(1, self.spec.max_tokens // len(names))
            docs = [d for c in names for d in limit_documents(load_corpora(c, split), tok, share)]
            specs = [ds.key_spec for ds in self.datastores.values()]
            self.log(f"forward pass over {corpora} ({split}, {len(docs)} documents)")
            ts, queries, _ = lm_scores(
                model,
                tok,
                docs,
                specs,
                self.spec.window,
                self.spec.min_context,
                self.spec.batch_size,
                self.progress,
                meta=self._forward_meta(split),
            )
            for role, ds in self.datastores.items():
                tmp = unique_tmp(qpaths[role], ".tmp.npy")
                np.save(tmp, queries[ds.key_spec].astype(np.float32))
                os.replace(tmp, qpaths[role])
            ts.save(dump)
        ts = TokenTable.load(dump)
        want = self._forward_meta(split)
        have = {k: ts.meta.get(k) for k in want}
        if have != json.loads(json.dumps(want)):
            diff = ", ".join(f"{k}: {have[k]} vs {want[k]}" for k in want if have[k] != want[k])
            raise MemlmError(f"{self.out} holds an analysis with other settings ({diff}): use another --out")
        return ts, {role: np.load(p, mmap_mode="r") for role, p in qpaths.items()}

    def _forward_meta(self, split: str) -> dict[str, Any]:
        s = self.spec
        corpora = s.valid if split == "valid" else s.test
        return {
            "model": s.model,
            "corpus": corpora,
            "split": split,
            "max_tokens": s.max_tokens,
            "analysis_window": [s.window, s.min_context],
            "dtype": s.dtype,
            "datastores": {role: str(ds.path) for role, ds in self.datastores.items()},
        }

    # -- datastores, indexes, neighbours ------------------------------------------------------------------------
    def datastore(self, role: str, fraction: float) -> Datastore:
        ds = self.datastores[role]
        if fraction >= 1.0:
            return ds
        folder = self.out / "ds" / f"{role}-{fraction:g}-seed{self.spec.seed}"
        if (folder / "manifest.json").exists():
            sub = Datastore.open(folder)
            made = sub.manifest.get("subsample", {})
            if (made.get("of"), made.get("fraction"), made.get("seed")) != (str(ds.path), fraction, self.spec.seed):
                raise MemlmError(f"{folder} holds another subsample ({made}): use another --out")
            if sub.manifest.get("created") != ds.manifest.get("created") or len(sub) > len(ds):
                raise MemlmError(f"{folder} was subsampled from another version of {ds.path}: use another --out")
            return sub
        self.log(f"subsampling {fraction:.0%} of {ds.path}")
        return ds.subsample(folder, fraction, seed=self.spec.seed)

    def index_path(self, ds: Datastore, metric: str) -> Path:
        factory = self.spec.factory or approx_factory(len(ds), ds.dim)
        path = ds.path / f"index-{metric}-{_slug(factory)}.faiss"
        meta = None if ds.index_problem(path) else index_lib.read_index_meta(path)  # stale or foreign: rebuild
        fresh = meta and (meta.get("n"), meta.get("metric"), meta.get("seed")) == (len(ds), metric, self.spec.seed)
        if not (path.exists() and fresh):
            self.log(f"building {factory} ({metric}) over {len(ds):,} keys of {ds.path}")
            index_lib.build_index(ds.keys, path, factory, metric, seed=self.spec.seed, progress=self.progress)
        return path

    def neighbour_settings(self, role: str, metric: str, fraction: float, setting: str, split: str) -> dict[str, Any]:
        """Everything a neighbour dump depends on (besides the forward pass, whose own cache refuses a mismatch)."""
        search, scores = SETTINGS[setting]
        ds = self.datastore(role, fraction)
        return {
            "role": role,
            "metric": metric,
            "fraction": fraction,
            "search": search,
            "scores": scores,
            "split": split,
            "k": self.spec.k,
            "datastore": _ds_identity(ds),
            "subsample_seed": self.spec.seed if fraction < 1.0 else None,
            "factory": (self.spec.factory or approx_factory(len(ds), ds.dim)) if search == "index" else None,
            "nprobe": self.spec.nprobe if search == "index" else None,
            "index_seed": self.spec.seed if search == "index" else None,
            "forward": self._forward_meta(split),
        }

    def neighbours(self, role: str, metric: str, fraction: float, setting: str, split: str) -> TokenTable:
        """The neighbour dump of one setting; cached under a name keyed by all its settings (stored inside too)."""
        search, scores = SETTINGS[setting]
        settings = self.neighbour_settings(role, metric, fraction, setting, split)
        name = f"{role}-{metric}-f{fraction:g}-{search}-{scores}-{split}-{_settings_key(settings)}.npz"
        path = self.out / "nb" / name
        want = json.loads(dumps_json(settings))
        if path.exists():
            cached = TokenTable.load(path)
            if cached.meta.get("cache_settings") == want:
                return cached
            self.log(f"{path} was made with other settings; recomputing it")
        ds = self.datastore(role, fraction)
        ts, queries = self.forward(split)
        index_path = self.index_path(ds, metric) if search == "index" else None
        self.log(f"retrieving {setting} ({role}, {metric}, {fraction:g} of the datastore) for {split}")
        dumped = ts.select()
        add_neighbours(
            dumped,
            np.array(queries[role], dtype=np.float32),
            ds,
            k=self.spec.k,
            search=search,
            scores=scores,
            nprobe=self.spec.nprobe,
            progress=self.progress,
            index_path=index_path,
            metric=metric,
        )
        dumped.meta["cache_settings"] = want
        path.parent.mkdir(parents=True, exist_ok=True)
        dumped.save(path)
        return dumped

    def setting_row(self, role: str, metric: str, fraction: float, setting: str, temperatures=None) -> dict[str, Any]:
        valid = self.neighbours(role, metric, fraction, setting, "valid")
        test = self.neighbours(role, metric, fraction, setting, "test")
        row = _dump_row(valid, test, temperatures or self.spec.tune_temperatures(), self.spec.k)
        if temperatures is None:  # Table 1 / 3 rows: also at the paper's τ = 1
            row["tau1"] = _dump_row(valid, test, (1.0,), self.spec.k)
        ds = self.datastore(role, fraction)
        row.update(h_ds=role, sim=metric, fraction=fraction, setting=setting, entries=len(ds), dim=ds.dim)
        return row

    # -- learned W_ds --------------------------------------------------------------------------------------------
    def learned_row(self, role: str, n: int) -> dict[str, Any]:
        from memlm.xu2023.generalized import load_learned_wds, save_learned_wds, train_learned_wds

        ds = self.datastores[role]
        s = self.spec
        learned = {k: getattr(s, f"learned_{k}") for k in ("steps", "batch", "lr", "patience", "log_every")}
        record = {"role": role, "n": n, "metric": "ip", **learned, "seed": s.seed, "datastore": _ds_identity(ds)}
        settings = json.loads(dumps_json(record))
        path = self.out / "learned" / f"{role}-n{n}-{_settings_key(settings)}.pt"
        vocab = int(ds.manifest["tokenizer"]["vocab_size"])
        valid_ts, valid_q = self.forward("valid")
        test_ts, test_q = self.forward("test")
        info_path = path.with_suffix(".json")
        info = json.loads(info_path.read_text()) if path.exists() and info_path.exists() else None
        if info is not None and info.get("settings") == settings:
            wds = load_learned_wds(path)
        else:
            self.log(f"training learned W_ds ({role}, n={n}) on {len(ds):,} (key, value) pairs of {ds.path}")
            t0 = time.perf_counter()
            wds, train_log = train_learned_wds(
                ds.keys,
                ds.values,
                vocab,
                n=n,
                metric="ip",
                batch_size=self.spec.learned_batch,
                lr=self.spec.learned_lr,
                max_steps=self.spec.learned_steps,
                seed=self.spec.seed,
                progress=self.progress,
                log_every=s.learned_log_every,
                **(
                    {}
                    if s.learned_patience is None
                    else {  # as many epochs as learned_steps needs; the plateau ends it sooner
                        "epochs": math.ceil(s.learned_steps * s.learned_batch / len(ds)),
                        "valid": (valid_q[role], valid_ts.targets),
                        "patience": s.learned_patience,
                    }
                ),
            )
            info = {"train_seconds": time.perf_counter() - t0, "log": train_log, "settings": settings}
            path.parent.mkdir(parents=True, exist_ok=True)
            save_learned_wds(wds, path)
            atomic_write_json(info_path, info)

        row = interpolation_row(
            torch.from_numpy(valid_ts.lm_logprob),
            wds.score(valid_q[role], valid_ts.targets),
            torch.from_numpy(test_ts.lm_logprob),
            wds.score(test_q[role], test_ts.targets),
        )
        last = info["log"][-1]  # train_learned_wds always logs the end
        # the updates behind the weights: all that were made (a fixed budget stops after one epoch), or with
        # patience the best valid point's
        steps = last["step"] if s.learned_patience is None else last["best_step"]
        row.update(h_ds=role, n=n, sim="ip", params=n * vocab * ds.dim, train_steps=steps,
                   train_seconds=info["train_seconds"], train_loss=last["loss"])  # fmt: skip
        if s.learned_patience is not None:
            row["stopped_at"] = last["step"]
            row["curve"] = [{k: e[k] for k in ("step", "loss", "valid_ppl")} for e in info["log"]]
        return row


#: The parts of the grid that ``skip`` (``memlm analyze --skip``) may leave out (Table 1, Fig. 2/4 and Table 3,
#: Fig. 5, Fig. 3 / Table 2).
ANALYSIS_PARTS = ("table1", "approx", "temperature", "learned")


def check_skip(skip: Sequence[str]) -> None:
    """Refuse a part name that is not in :data:`ANALYSIS_PARTS` (a typo would silently run the part)."""
    unknown = [s for s in skip if s not in ANALYSIS_PARTS]
    if unknown:
        raise MemlmError(
            f"{option('--skip')}: unknown part {', '.join(map(repr, unknown))}; the parts are "
            f"{', '.join(ANALYSIS_PARTS)}"
        )


def run_analysis(
    spec: AnalysisSpec, out: str | os.PathLike, progress: bool = True, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the grid of the module docstring (resuming from ``out``) and write the JSON, tables and figures."""
    check_skip(spec.skip)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(spec, out, progress, log)
    results: dict[str, Any] = {"spec": asdict(spec), "timings": {}}
    t0 = time.perf_counter()
    valid_ts, _ = run.forward("valid")
    test_ts, _ = run.forward("test")
    results["base"] = {
        "valid_ppl": perplexity(torch.from_numpy(valid_ts.lm_logprob)),
        "test_ppl": perplexity(torch.from_numpy(test_ts.lm_logprob)),
        "valid_tokens": len(valid_ts),
        "test_tokens": len(test_ts),
    }
    results["timings"]["forward"] = time.perf_counter() - t0
    roles = list(run.datastores)
    approx_role = "att" if "att" in roles else roles[0]
    parts = {  # ANALYSIS_PARTS, each a list of rows
        "table1": lambda: [run.setting_row(r, m, 1.0, "FAISS mask, FAISS score") for r in roles for m in ("l2", "ip")],
        "approx": lambda: [run.setting_row(approx_role, "l2", f, s) for f in sorted(spec.fractions) for s in SETTINGS],
        "temperature": lambda: [
            run.setting_row(approx_role, "l2", f, s, temperatures=(t,))
            for f in sorted({min(spec.fractions), 1.0})
            for s in SETTINGS
            for t in spec.temperatures
        ],
        "learned": lambda: [run.learned_row(role, n) for role in roles for n in spec.learned_n],
    }
    for name, rows in parts.items():
        if name not in spec.skip:
            t0 = time.perf_counter()
            results[name] = rows()
            results["timings"][name] = time.perf_counter() - t0
    atomic_write_json(out / "analysis.json", results)  # non-finite numbers become null
    write_report(results, out)
    return results


# ---------------------------------------------------------------------------------------------------- report


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return "∞"
    return f"{x:.{digits}f}"


def _params(row: dict[str, Any]) -> str:
    n = row["entries"] * row["dim"] if "entries" in row else row["params"]
    return f"{n / 1e6:.1f}M"


_PAPER_COLS = ["paper Interp.", "paper Oracle"]


def _table(header: Sequence[str], rows: list[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def gain_explained(base: float, learned: float, knn: float) -> float:
    """Share of the kNN-LM's perplexity gain that the learned W_ds recovers: (base - learned) / (base - kNN)."""
    return (base - learned) / (base - knn) if base != knn else float("nan")


def tau1_row(results: dict[str, Any], row: dict[str, Any]) -> dict[str, Any] | None:
    """The τ = 1 version of a Table 1 / Table 3 row: its own ``tau1`` entry, or else the Fig. 5 sweep's row with the
    same h_ds, similarity, datastore fraction and setting at τ = 1 (λ tuned on valid in both); None when neither."""
    if "tau1" in row:
        return row["tau1"]
    for r in results.get("temperature", []):
        same = all(r[k] == row[k] for k in ("h_ds", "sim", "fraction", "setting"))
        if same and abs(r["temperature"] - 1.0) < 1e-9:
            return r
    return None


def tau1_tables(results: dict[str, Any]) -> str:
    """Tables 1 and 3 at the paper's τ = 1 beside the τ-tuned rows (markdown; rows without a τ = 1 value say so)."""
    parts = []
    for name, title, paper_of in (
        ("table1", "Table 1 at τ = 1 (the paper's setting) beside τ tuned on valid", None),
        ("approx", "Table 3 at τ = 1 (the paper's setting) beside τ tuned on valid", "table3"),
    ):
        if name not in results:
            continue
        rows = []
        for r in results[name]:
            t1 = tau1_row(results, r)
            if paper_of:
                p = PAPER["table3"][r["setting"]] if r["fraction"] == 1.0 else None
                label = [f"{r['fraction']:.0%}", r["setting"]]
            else:
                p = PAPER["table1"][(r["h_ds"], r["sim"])]
                label = [r["h_ds"], r["sim"].upper()]
            p_interp = _f(p[1] if paper_of else p[0]) if p else "-"
            missing = "not run"
            rows.append(
                [
                    *label,
                    _f(t1["lambda"]) if t1 else missing,
                    _f(t1["interp_ppl"]) if t1 else missing,
                    _f(t1["oracle_ppl"]) if t1 else missing,
                    _f(r["temperature"], 1),
                    _f(r["interp_ppl"]),
                    p_interp,
                ]
            )
        first = ["datastore", "setting"] if paper_of else ["h_ds", "⊗"]
        header = [*first, "λ (τ = 1)", "Interp. τ = 1", "Oracle τ = 1", "tuned τ", "Interp. tuned τ", "paper Interp."]
        parts.append(f"### {title}\n\n" + _table(header, rows))
    return "\n\n".join(parts)


_SCORE_COLUMNS = ("PPL", "λ", "τ", "Interp. PPL", "Oracle", "paper Interp.", "paper Oracle")  # Tables 1 and 3


def write_report(results: dict[str, Any], out: Path) -> str:
    """``tables.md`` (Tables 1-3, the n sweep; the paper's numbers beside ours) and the PNG figures."""
    base = results["base"]["test_ppl"]
    parts = [
        f"Base LM test perplexity {base:.3f} ({results['base']['test_tokens']:,} tokens; "
        f"valid {results['base']['valid_ppl']:.3f}, {results['base']['valid_tokens']:,} tokens). "
        f"λ and τ are tuned on valid per row; paper: Xu et al. 2023 (base {PAPER['base']})."
    ]
    if "table1" in results:
        rows = [["Base LM", "-", "-", "0", _f(base), "-", "-", "-", "-", _f(PAPER["base"]), "-"]]
        for r in results["table1"]:
            p = PAPER["table1"][(r["h_ds"], r["sim"])]
            rows.append(
                [
                    f"kNN-LM-{r['sim'].upper()}",
                    r["h_ds"],
                    r["sim"].upper(),
                    _params(r),
                    _f(r["memory_ppl"]),
                    _f(r["lambda"]),
                    _f(r["temperature"], 1),
                    _f(r["interp_ppl"]),
                    _f(r["oracle_ppl"]),
                    _f(p[0]),
                    _f(p[1]),
                ]
            )
        header = ["", "h_ds", "⊗", "+#params", *_SCORE_COLUMNS]
        parts.append("### Table 1: h_ds and similarity (FAISS mask and score)\n\n" + _table(header, rows))
    if "learned" in results:
        knn = {(r["h_ds"], r["sim"]): r for r in results.get("table1", [])}
        rows = [["Base LM", "-", "-", "-", "0", _f(base), "-", "-", "-", "-"]]
        for role in ("att", "ffn"):
            k = knn.get((role, "ip"))
            if k:
                p = PAPER["table1"][(role, "ip")]
                rows.append(
                    [f"kNN-LM w/{role.upper()}", role, "Big", "IP", _params(k), _f(k["memory_ppl"]),
                     _f(k["interp_ppl"]), _f(k["oracle_ppl"]), "∞", _f(p[0])]
                )  # fmt: skip
            for r in results["learned"]:
                if r["h_ds"] == role and r["n"] == 1:
                    p = PAPER["learned"][(role, 1)]
                    rows.append(
                        [f"Learned W_ds w/{role.upper()}", role, "1x", "IP", _params(r), _f(r["memory_ppl"]),
                         _f(r["interp_ppl"]), _f(r["oracle_ppl"]), _f(p[0]), _f(p[1])]
                    )  # fmt: skip
        header = ["", "h_ds", "N_ds", "⊗", "+#params", "PPL", "Interp.", "Oracle", "paper PPL", "paper Interp."]
        text = "### Table 2: learned W_ds vs kNN-LM\n\n" + _table(header, rows)
        shares = []
        for role in ("att", "ffn"):
            k = knn.get((role, "ip"))
            lr = [r for r in results["learned"] if r["h_ds"] == role and r["n"] == 1]
            if k and lr:
                share = gain_explained(base, lr[0]["interp_ppl"], k["interp_ppl"])
                pk, pl = PAPER["table1"][(role, "ip")][0], PAPER["learned"][(role, 1)][1]
                paper_share = gain_explained(PAPER["base"], pl, pk)
                shares.append(f"{role}: {share:.0%} (paper {paper_share:.0%} from its Table 2 numbers)")
        if shares:
            text += (
                "\n\nShare of the kNN-LM gain recovered by the learned V x D matrix, (base - learned) / (base - kNN): "
                + "; ".join(shares)
                + "."
            )
        parts.append(text)
        rows = []
        for r in results["learned"]:
            p = PAPER["learned"].get((r["h_ds"], r["n"]))
            rows.append(
                [r["h_ds"], f"{r['n']}x", _params(r), _f(r["memory_ppl"]), _f(r["lambda"], 2), _f(r["interp_ppl"]),
                 _f(r["oracle_ppl"]), _f(p[1]) if p else "-"]
            )  # fmt: skip
        header = ["h_ds", "n", "+#params", "PPL", "λ", "Interp.", "Oracle", "paper Interp."]
        parts.append("### Learned W_ds vs n (paper Table 5 / Fig. 3)\n\n" + _table(header, rows))
    if "approx" in results:
        rows = [["Base LM", "-", "-", "-", _f(base), "-", "-", "-", "-", _f(PAPER["base"]), "-"]]
        for r in results["approx"]:
            p = PAPER["table3"][r["setting"]] if r["fraction"] == 1.0 else None
            rows.append(
                [f"kNN-LM w/{r['setting']}", f"{r['fraction']:.0%}", r["h_ds"], r["sim"].upper(),
                 _f(r["memory_ppl"]), _f(r["lambda"]), _f(r["temperature"], 1), _f(r["interp_ppl"]),
                 _f(r["oracle_ppl"]), _f(p[1]) if p else "-", _f(p[2]) if p else "-"]
            )  # fmt: skip
        header = ["", "datastore", "h_ds", "⊗", *_SCORE_COLUMNS]
        parts.append("### Table 3: approximate vs exact kNN (FAISS vs real mask and score)\n\n" + _table(header, rows))
    if "temperature" in results:
        best = {}
        for r in results["temperature"]:
            key = (r["fraction"], r["setting"])
            if key not in best or r["valid_ppl"] < best[key]["valid_ppl"]:  # chosen on valid, reported on test
                best[key] = r
        rows = []
        for (f, setting), r in sorted(best.items()):
            at1 = [x for x in results["temperature"] if (x["fraction"], x["setting"]) == (f, setting)]
            t1 = min(at1, key=lambda x: abs(x["temperature"] - 1.0))
            rows.append([f"{f:.0%}", setting, _f(r["temperature"], 1), _f(r["interp_ppl"]), _f(t1["interp_ppl"])])
        header = ["datastore", "setting", "best τ (on valid)", "Interp. at best τ", "Interp. at τ = 1"]
        temps = sorted({r["temperature"] for r in results["temperature"]})
        parts.append(
            f"### Temperature (Fig. 5): τ chosen on valid in {_f(temps[0], 1)}..{_f(temps[-1], 1)} vs τ = 1\n\n"
            + _table(header, rows)
        )
    tau1 = tau1_tables(results)
    if tau1:
        parts.append(tau1)
    text = "\n\n".join(parts) + "\n"
    (out / "tables.md").write_text(text)
    _figures(results, out)
    return text


def _figures(results: dict[str, Any], out: Path) -> None:
    from memlm.experiments.plots import finish_figure, pyplot

    plt = pyplot()
    base = results["base"]["test_ppl"]
    if "approx" in results:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for setting in SETTINGS:
            rows = sorted((r for r in results["approx"] if r["setting"] == setting), key=lambda r: r["fraction"])
            ax.plot([r["fraction"] for r in rows], [r["interp_ppl"] for r in rows], marker="o", label=setting)
        ax.axhline(base, color="black", lw=1, ls="--", label="base LM")
        finish_figure(fig, out / "fig_datastore_ratio.png", ax, xlabel="Ratio to full datastore size",
                      ylabel="Interpolated perplexity (test)",
                      title="Fig. 2/4: datastore size, approximate vs exact kNN")  # fmt: skip
    if "learned" in results:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for role in ("att", "ffn"):
            rows = sorted((r for r in results["learned"] if r["h_ds"] == role), key=lambda r: r["n"])
            if rows:
                ax.plot(
                    [r["n"] for r in rows], [r["interp_ppl"] for r in rows], marker="o", label=f"learned W_ds, {role}"
                )
        ax.axhline(base, color="black", lw=1, label="base LM")
        for r in results.get("table1", []):
            if r["sim"] == "ip" and r["h_ds"] == "att":
                ax.axhline(r["interp_ppl"], color="red", lw=1, label="kNN-LM (att, IP, full datastore)")
        finish_figure(fig, out / "fig_learned_n.png", ax, xlabel="Number of trained embeddings per word (n)",
                      ylabel="Interpolated perplexity (test)", title="Fig. 3: learned W_ds of nV x D")  # fmt: skip
    if "temperature" in results:
        fracs = sorted({r["fraction"] for r in results["temperature"]})
        fig, axes = plt.subplots(1, len(fracs), figsize=(5 * len(fracs), 4), squeeze=False)
        for ax, f in zip(axes[0], fracs, strict=True):
            for setting in SETTINGS:
                rows = sorted(
                    (r for r in results["temperature"] if r["fraction"] == f and r["setting"] == setting),
                    key=lambda r: r["temperature"],
                )
                ax.plot([r["temperature"] for r in rows], [r["interp_ppl"] for r in rows], label=setting)
            ax.set_title(f"Fig. 5: {f:.0%} datastore")
            ax.set_xlabel("Softmax temperature τ")
            ax.set_ylabel("Interpolated perplexity (test)")
            ax.legend(fontsize=8)
        finish_figure(fig, out / "fig_temperature.png")


__all__ += ["gain_explained", "FIG5_TEMPERATURES", "SETTINGS", "ROLES"]
