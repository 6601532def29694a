"""memlm's kNN-LM eval against knn-transformers' ``KNNWrapper`` (Alon et al. 2022, neulab/knn-transformers): same model,
same datastore and FAISS index, same tokens, same windows ("memlm vs knn-transformers >= 2x").

    git clone https://github.com/neulab/knn-transformers /path/to/knn-transformers   # or: git archive HEAD | tar -x
    python benchmarks/speed/vs_knn_transformers.py --datastore data/ev-intervals/ds50k \\
        --knn-transformers /path/to/knn-transformers --work runs/vs-kt --tokens 20000 \\
        --out docs/results/speed/vs_knn_transformers.json

Their code is not part of memlm: ``--knn-transformers`` is a checkout of their repository, and its ``knnlm.py`` is
imported at run time, unchanged. What the harness adds around it, at run time only:

* **Llama in their layer table.** ``KNNWrapper.model_layer_to_capture`` knows bart, gpt2, marian and t5; for GPT-2 its
  ``last_ffn_input`` key is the input of the last block's MLP (``h[-1].mlp``, after ``ln_2``). The harness adds the same
  entry for ``llama`` (SmolLM2): the input of ``model.layers[-1].mlp``, i.e. after the last layer's
  ``post_attention_layernorm``, which is memlm's ``ffn_in@-1`` (the datastore's key, checked against the model).
* **A Flat index.** Their ``setup_faiss`` calls ``make_direct_map()`` on the index read from disk (for
  ``recompute_dists``, which their eval leaves off). An ``IndexFlat`` keeps its vectors and has no direct map to
  make, so for an index without that method their module's ``faiss.read_index`` returns the index behind a proxy
  whose ``make_direct_map`` does nothing and which keeps their ``nprobe`` (FAISS >= 1.8 refuses an attribute an
  index does not have; a Flat index searches everything); every other attribute is the index's own. IVF indexes pass
  untouched.
* **Their files.** ``KNNWrapper`` reads ``{dir}/dstore_{model_type}_{N}_{D}_vals.npy`` (a raw int32 ``[N, 1]`` memmap)
  and ``{dir}/index_{model_type}_{N}_{D}.indexed``; the harness writes memlm's values there once (and the float16 keys
  as ``..._keys.npy``, which their eval does not read: ``no_load_keys`` is on by default) and links the datastore's
  own FAISS index file under their name (untimed). Both sides search the very same index file.

The same scoring on both sides (Khandelwal et al. 2020, Eq. 2-3)::

    p_kNN(w | c) = sum_{i in top-k, v_i = w} exp(-d_i / tau) / sum_{i in top-k} exp(-d_i / tau)
    p(w | c)     = (1 - lambda) p_LM(w | c) + lambda p_kNN(w | c)

``d_i`` is the distance FAISS returns for an L2 index: the (approximate, for PQ) *squared* L2 distance. knn-transformers
takes ``softmax(-d / knn_temp)`` of it (``knns_to_log_prob``, ``recompute_dists`` off as in ``run_clm.py``); memlm's
``scores="index"`` are ``-d`` from the same search (``memlm.storage.index.search``) divided by its temperature. So
``knn_temp = tau`` makes them the same function; ``k``, ``nprobe`` (ignored by a Flat index), ``lambda`` (their
``lmbda``) and ``tau`` are passed to both from one set of values (the datastore's calibration unless given).

Windows: both sides score the same positions of the same WikiText-2 test stream (``--tokens`` scored tokens of the
leading documents, tokenized by memlm with an EOS after each document): windows of ``--window`` 1024 advancing by
``--stride`` 512, each scoring its last 512 targets (the first window all of its targets). That is ``run_clm.py``'s
``group_texts`` protocol too (block_size 1024, stride 512, labels -100 before the last ``stride`` targets); the harness
builds its ``input_ids`` / ``labels`` (-100 where not scored) / ``attention_mask`` (all ones, as ``group_texts``) from
memlm's windows, in batches of ``--batch-size`` right-padded to the longest window of the batch (``run_clm`` pads every
window to 1024; only the first and the last window are shorter), and calls the wrapped model as the HF Trainer's eval
does: ``model(input_ids, attention_mask, labels)``, perplexity from ``loss`` times the batch's scored tokens.

What each side does per batch (the difference being timed, besides the shared forward pass):

* knn-transformers: the full ``[B, T, V]`` logits for every position, ``log_softmax`` over all of them, one FAISS
  search of the batch's scored queries (``k`` neighbours each), a dense ``[n, V]`` kNN distribution (``scatter_add``
  then ``log``), ``logaddexp`` with the LM over the whole vocabulary, written back into the logits, then HF's
  cross-entropy (a second ``log_softmax``) over ``[B, T, V]``;
* memlm (``score_tokens`` + ``perplexities``, what ``memlm eval --memory DS`` runs): the head only at the scored
  positions, the target's log-probability and entropy per token, the keys by hook, then the search (after the forward
  pass, or overlapped with ``--pipeline``) and Eq. 2-3 only at each target, plus the perplexities' bootstrap intervals.

Each side runs in its own process (``--side``, started by the harness) after loading the model and index and one
warm-up batch (untimed); the timed region is windowing + forward + search + scoring to the perplexity. Per-token
kNN-LM log-probabilities of both are written to ``--work`` and compared (max and mean absolute difference). Both run in
float32 on the same threads (torch's and FAISS's defaults, or ``OMP_NUM_THREADS``); ``--memlm-dtype auto`` runs memlm
on ``memlm eval``'s default ``--dtype auto`` instead (bfloat16 where the CPU has it natively; knn-transformers stays in
float32, as ``run_clm.py`` loads it), and the perplexity difference then includes that path's error.

Time: ``--tokens 20000`` took 327 s in all on 2 idle cores (knn-transformers' side 117 s timed, memlm's 80 s, the
rest loading and the idle wait; docs/results/speed/vs_knn_transformers.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import numpy as np  # noqa: E402
import protocol  # noqa: E402
import torch  # noqa: E402

from memlm.core.distribution import perplexity  # noqa: E402
from memlm.data.corpora import load_documents  # noqa: E402
from memlm.data.windows import batched, limit_documents, sliding_windows, tokenize_documents  # noqa: E402
from memlm.errors import MemlmError  # noqa: E402
from memlm.io.fileio import atomic_write_bytes, atomic_write_json  # noqa: E402
from memlm.models.allocator import allocator_state  # noqa: E402
from memlm.models.forward import collate  # noqa: E402
from memlm.models.keys import KeySpec, num_layers  # noqa: E402
from memlm.models.resources import load_causal_lm  # noqa: E402
from memlm.storage.datastore import Datastore  # noqa: E402

SIDES = ("knn-transformers", "memlm")
LLAMA_LAYERS = {  # their model_layer_to_capture entry for "llama", by KEY_TYPE name: (layer of the model, its input?)
    "last_ffn_input": (lambda model: model.base_model.layers[-1].mlp, True),  # memlm's ffn_in@-1
    "last_ffn_output": (lambda model: model.base_model.layers[-1], False),  # memlm's block_out@-1
}
KEY = KeySpec("ffn_in", -1)  # what their last_ffn_input captures for a Llama model (see the docstring)


# ------------------------------------------------------------------------------------------------ shared inputs


def eval_documents(args: argparse.Namespace, tok) -> list:
    """The leading WikiText-2 test documents with ``--tokens`` tokens (EOS included): one list for both sides."""
    return limit_documents(load_documents("wikitext2", "test"), tok, args.tokens)


def their_prefix(work: Path, model_type: str, n: int, d: int) -> tuple[Path, Path]:
    """knn-transformers' file names (``get_dstore_path`` / ``get_index_path`` of their knnlm.py)."""
    return work / f"dstore_{model_type}_{n}_{d}", work / f"index_{model_type}_{n}_{d}.indexed"


def export_datastore(ds: Datastore, work: Path, model_type: str) -> dict[str, Any]:
    """memlm's keys (float16 ``[N, D]``) and values (int32 ``[N, 1]``) as knn-transformers' raw memmaps, and a link
    to the datastore's FAISS index under their index name. Written once; a folder already holding the same bytes is
    reused (checked by size and content)."""
    n, d = len(ds), ds.dim
    prefix, index_link = their_prefix(work, model_type, n, d)
    work.mkdir(parents=True, exist_ok=True)
    wrote = []
    for suffix, array in (
        ("_keys.npy", np.asarray(ds.keys, np.float16)),
        ("_vals.npy", np.asarray(ds.values, np.int32)),
    ):
        path = Path(f"{prefix}{suffix}")
        array = np.ascontiguousarray(array.reshape(n, -1))
        if (
            path.exists()
            and path.stat().st_size == array.nbytes
            and np.array_equal(np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape), array)
        ):
            continue
        atomic_write_bytes(path, array.tobytes())  # a raw memmap: no .npy header, as their np.memmap reads it
        wrote.append(path.name)
    target = ds.index_path.resolve()
    if index_link.is_symlink() or index_link.exists():
        if index_link.resolve() != target:
            index_link.unlink()
    if not index_link.exists():
        index_link.symlink_to(target)
    return {"work": str(work), "prefix": str(prefix), "index": str(target), "written": wrote, "entries": n, "dim": d}


# ------------------------------------------------------------------------------------------------ knn-transformers


class _FlatDirectMap:
    """An index read by their ``setup_faiss``, with a ``make_direct_map`` that does nothing: ``IndexFlat`` stores its
    vectors (``reconstruct`` needs no map) and has no such method. Everything else is the index's own."""

    def __init__(self, index) -> None:
        object.__setattr__(self, "_index", index)

    def make_direct_map(self) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self._index, name)

    def __setattr__(self, name: str, value) -> None:  # their nprobe stays here: a Flat index probes nothing
        if hasattr(self._index, name):
            setattr(self._index, name, value)
        else:
            object.__setattr__(self, name, value)


def import_their_knnlm(checkout: Path):
    """Their ``knnlm.py`` from ``checkout``, with the run-time additions of the module docstring (Llama keys, Flat)."""
    if not (checkout / "knnlm.py").exists():
        raise MemlmError(
            f"{checkout} has no knnlm.py: give --knn-transformers a checkout of "
            "https://github.com/neulab/knn-transformers (git clone, or git archive HEAD | tar -x)"
        )
    sys.path.insert(0, str(checkout))
    import knnlm  # their module

    layers = {knnlm.KEY_TYPE[name]: entry for name, entry in LLAMA_LAYERS.items()}
    knnlm.KNNWrapper.model_layer_to_capture.setdefault("llama", layers)
    real = knnlm.faiss

    def read_index(*a, **kw):
        index = real.read_index(*a, **kw)
        return index if hasattr(index, "make_direct_map") else _FlatDirectMap(index)

    knnlm.faiss = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    knnlm.faiss.read_index = read_index
    return knnlm


def their_batches(windows, batch_size: int, pad_id: int):
    """``(input_ids, attention_mask, labels)`` per batch of memlm windows, as ``run_clm``'s ``group_texts`` makes them:
    labels -100 where a position is not scored (and on padding), attention all ones (right padding)."""
    for batch in batched(windows, batch_size):
        ids, _ = collate(batch, pad_id)  # memlm's right padding
        labels = torch.full_like(ids, -100)
        for r, w in enumerate(batch):
            labels[r, w.score_from : len(w.input_ids)] = ids[r, w.score_from : len(w.input_ids)]
        yield ids, torch.ones_like(ids), labels


def run_theirs(args, model, tok, docs, params: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
    knnlm = import_their_knnlm(Path(args.knn_transformers))
    work = Path(args.work)
    ds = Datastore.open(args.datastore)
    wrapper = knnlm.KNNWrapper(
        dstore_size=len(ds),
        dstore_dir=str(work),
        dimension=ds.dim,
        knn_sim_func=knnlm.DIST.l2,  # run_clm's defaults from here on
        knn_keytype=knnlm.KEY_TYPE.last_ffn_input,
        no_load_keys=True,
        move_dstore_to_mem=True,
        knn_gpu=False,
        recompute_dists=False,
        k=params["k"],
        lmbda=params["lambda"],
        knn_temp=params["temperature"],
        probe=params["nprobe"],
    )
    wrapper.break_into(model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    @torch.no_grad()
    def score(documents) -> tuple[float, int, np.ndarray]:
        windows = sliding_windows(tokenize_documents(documents, tok), args.window, stride=args.stride)
        nll, count, per_token = 0.0, 0, []
        for ids, mask, labels in their_batches(windows, args.batch_size, pad_id):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            n = int((labels[:, 1:] != -100).sum())
            nll += float(out.loss) * n
            count += n
            scored = labels[:, 1:] != -100  # row-major = memlm's order (window by window, positions ascending)
            lp = out.logits[:, :-1].gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            per_token.append(lp[scored].float().numpy())
        return nll, count, np.concatenate(per_token)

    score(limit_documents(docs, tok, min(args.window, 256)))  # warm-up: one short batch through hooks and search

    def timed() -> dict[str, Any]:
        nll, count, per_token = score(docs)
        return {"tokens": count, "nll_sum": nll, "_per_token": per_token}

    rec = protocol.timed("knn-transformers", timed)
    per_token = rec.pop("_per_token")
    rec.update(
        tokens_per_s=rec["tokens"] / rec["seconds"],
        ppl=float(np.exp(rec["nll_sum"] / rec["tokens"])),
        ppl_from_per_token=perplexity(per_token),
        knn_transformers=their_version(Path(args.knn_transformers)),
    )
    wrapper.break_out()
    return rec, per_token


def their_version(checkout: Path) -> dict[str, Any]:
    """Which knn-transformers ran: the checkout's commit (None for an export) and the sha256 of its knnlm.py."""
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = out.stdout.strip() or None
    except OSError:
        commit = None
    return {"commit": commit, "knnlm_py_sha256": hashlib.sha256((checkout / "knnlm.py").read_bytes()).hexdigest()}


# ------------------------------------------------------------------------------------------------ memlm


def run_memlm(args, model, tok, docs, params: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
    from memlm.core.distribution import mix
    from memlm.knnlm.evaluate import perplexities
    from memlm.knnlm.scoring import score_tokens

    ds = Datastore.open(args.datastore)
    options = {"k": params["k"], "nprobe": params["nprobe"], "window": args.window, "stride": args.stride,
               "pipeline": args.pipeline}  # fmt: skip
    score_tokens(model, tok, limit_documents(docs, tok, min(args.window, 256)), ds, progress=False, **options)  # warm

    def timed() -> dict[str, Any]:
        ts = score_tokens(model, tok, docs, ds, batch_size=args.batch_size, progress=False, **options)
        t0 = time.perf_counter()
        res = perplexities(ts, lam=params["lambda"], temperature=params["temperature"])
        return {"tokens": len(ts), "ppl": res["knn_ppl"], "base_ppl": res["base_ppl"], "_ts": ts,
                "seconds_forward": ts.meta["seconds_forward"], "seconds_search": ts.meta.get("seconds_search"),
                "seconds_perplexities": time.perf_counter() - t0}  # fmt: skip

    rec = protocol.timed("memlm", timed)
    ts = rec.pop("_ts")
    knn = ts.logprob("knn", temperature=params["temperature"]).float()
    lam = params["lambda"]
    per_token = mix([torch.from_numpy(ts.lm_logprob), knn], weights=[1 - lam, lam]).numpy()
    rec.update(tokens_per_s=rec["tokens"] / rec["seconds"], ppl_from_per_token=perplexity(per_token))
    return rec, per_token


# ------------------------------------------------------------------------------------------------ driver


def run_side(args: argparse.Namespace) -> None:
    """One side in this process: load (untimed), warm up, time, write ``{work}/{side}.json`` and ``.npy``."""
    torch.set_grad_enabled(False)
    params = json.loads(args.params)
    model, tok = load_causal_lm(args.model, dtype=args.memlm_dtype if args.side == "memlm" else "float32")
    ds = Datastore.open(args.datastore)
    ds.check_compatible(model, tok)
    n_layers = num_layers(model)
    if ds.key_spec.normalized(n_layers) != KEY.normalized(n_layers):
        raise MemlmError(f"the datastore's key is {ds.key_spec}, knn-transformers' last_ffn_input is ffn_in@-1: "
                         "give a datastore built with --key ffn_in@-1")  # fmt: skip
    docs = eval_documents(args, tok)
    run = run_theirs if args.side == "knn-transformers" else run_memlm
    rec, per_token = run(args, model, tok, docs, params)
    rec.update(
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(),
        allocator=allocator_state(),
    )
    np.save(Path(args.work) / f"{args.side}.per_token.npy", per_token.astype(np.float32))
    atomic_write_json(Path(args.work) / f"{args.side}.json", rec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datastore", required=True, help="a memlm datastore folder (its FAISS index is searched)")
    p.add_argument("--knn-transformers", required=True, help="a checkout of github.com/neulab/knn-transformers")
    p.add_argument("--work", required=True, help="folder for their memmaps and each side's result (outside git)")
    p.add_argument("--out", required=True, help="JSON file of the results")
    p.add_argument("--model", default=None, help="default: the datastore's model (smollm2-135m)")
    p.add_argument("--tokens", type=int, default=20_000, help="WikiText-2 test tokens (leading documents)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--lambda", dest="lam", type=float, default=None, help="default: the datastore's calibration")
    p.add_argument("--temperature", type=float, default=None, help="τ = their knn_temp; default: the calibration")
    p.add_argument("--pipeline", action="store_true", help="memlm's --pipeline (search overlapped with the forward)")
    p.add_argument(
        "--memlm-dtype",
        default="float32",
        choices=("float32", "bfloat16", "auto"),
        help="memlm's dtype (default float32, as knn-transformers always runs here; auto = memlm eval's default "
        "--dtype auto, bfloat16 on CPUs with native bf16: then the perplexities differ by that path's error)",
    )
    p.add_argument("--sides", default=",".join(SIDES), help="order of the runs (each in its own process)")
    p.add_argument(
        "--their-allocator",
        choices=("default", "memlm"),
        default="default",
        help="the C allocator on knn-transformers' side: default = glibc's defaults, as their code runs (it loads "
        "through transformers, which leaves the allocator alone; memlm's loader, used here for both sides, would "
        "tune it, so MEMLM_MALLOC=default is set there); memlm = memlm's tuning on both sides",
    )
    p.add_argument("--wait-idle", type=float, default=300, help="seconds to wait for an idle machine (default 300)")
    p.add_argument("--force", action="store_true", help="run on a busy machine; results are marked not idle")
    p.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--params", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        run_side(args)
        return
    from memlm.knnlm.calibration import knn_parameters

    sides = args.sides.split(",")
    if not sides or any(s not in SIDES for s in sides):
        sys.exit(f"--sides takes {' and/or '.join(SIDES)}, comma-separated")
    ds = Datastore.open(args.datastore)
    args.model = args.model or ds.model_name or "smollm2-135m"
    lam, temperature, origin = knn_parameters(ds, args.lam, args.temperature)
    params = {"k": args.k, "nprobe": args.nprobe, "lambda": lam, "temperature": temperature}
    t_start = time.perf_counter()
    idle = protocol.idle_check(args.force, args.wait_idle)
    model_type = ds.manifest["model"]["architecture"].removesuffix("ForCausalLM").lower()
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": protocol.machine(),
        "idle_before": idle,
        "settings": {**vars(args), "model_type": model_type},
        "parameters": {**params, "origin": origin},
        "export": protocol.timed("export", lambda: export_datastore(ds, Path(args.work), model_type)),
    }
    for i, side in enumerate(sides):
        if i:  # the previous side's own threads must leave the load average before the next is timed
            result[f"idle_before_{side}"] = protocol.wait_for_idle(
                protocol.IDLE_BUSY, protocol.IDLE_LOAD, max_wait=args.wait_idle
            )
        env = dict(os.environ)
        if side == "knn-transformers" and args.their_allocator == "default":
            env["MEMLM_MALLOC"] = "default"
        cmd = [
            sys.executable,
            __file__,
            *sys.argv[1:],
            "--model",
            args.model,
            "--side",
            side,
            "--params",
            json.dumps(params),
        ]
        subprocess.run(cmd, check=True, env=env)
        result[side] = json.loads((Path(args.work) / f"{side}.json").read_text())
        print(f"[{side}] {result[side]['tokens_per_s']:.1f} tok/s, ppl {result[side]['ppl']:.4f}", flush=True)
    if len(sides) == 2:
        a, b = (np.load(Path(args.work) / f"{s}.per_token.npy").astype(np.float64) for s in SIDES)
        kt, ml = result["knn-transformers"], result["memlm"]
        same = len(a) == len(b)
        result["comparison"] = {
            "ratio_memlm_over_knn_transformers": ml["tokens_per_s"] / kt["tokens_per_s"],
            "same_scored_tokens": same and kt["tokens"] == ml["tokens"],
            "relative_ppl_difference": ml["ppl"] / kt["ppl"] - 1,
            "per_token_abs_diff_max": float(np.abs(a - b).max()) if same else None,
            "per_token_abs_diff_mean": float(np.abs(a - b).mean()) if same else None,
        }
        print(json.dumps(result["comparison"], indent=1), flush=True)
    result["load_avg_at_end"] = protocol.load_average()
    result["total_s"] = time.perf_counter() - t_start
    atomic_write_json(args.out, result)
    print(f"wrote {args.out} ({result['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
