"""Learned W_ds trained until it plateaus (Xu et al. 2023, Sec. 4.1 / Table 2).

    python benchmarks/papers/xu2023/learned_wds_curve.py --label smollm2 --model smollm2-135m \
        --datastore-att runs/key_types/ds-ffn_in-29 --datastore-ffn runs/key_types/ds-final --corpus wiki \
        --valid-tokens 10000 --test-tokens 20000 --window 512 --min-context 128 --out runs/key_types \
        --json docs/results/learned_wds/smollm2.json

Xu et al. replace the datastore by a learned V x D matrix W_ds read by the same representation h_ds (Eq. 5 with
``mask-to-k`` over all V entries, IP similarity, τ = 1) and report that it recovers ~55% of the kNN-LM's gain
("att" = ``ffn_in`` of the last layer). A matrix trained for a fixed, small budget says nothing about that claim,
so here each W_ds (one for att, one for ffn) is trained on its datastore's own (h_ds, next token) pairs with AdamW
(lr 1e-3, batches of 512, as ``memlm analyze``) *until its memory-only perplexity on held-out text stops improving*
(``train_learned_wds(..., patience=P)``: P log points without a gain of 1e-3 nats; the best weights are kept).

For each role the JSON holds the training curve (memory-only validation perplexity every ``--log-every`` updates),
the step where it plateaued, and Table 2's row on test: the learned matrix alone and interpolated with the LM (λ
tuned on valid), beside the kNN-LM with the same datastore, keys and similarity (exact inner-product search,
k = 1024, τ = 1 and λ tuned on valid, as the paper's Table 2), and the share of the kNN-LM gain the matrix recovers,
(base - learned) / (base - kNN). A PNG plots the curves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "knnlm"))  # benchmarks/papers/knnlm/knnlm_sweeps.py

from knnlm_sweeps import add_forward_args, forward, log, open_run  # noqa: E402

from memlm.experiments.xu2023_analysis import gain_explained, interpolation_row  # noqa: E402
from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.knnlm.evaluate import add_neighbours, perplexities  # noqa: E402
from memlm.mixing.report import fit_table  # noqa: E402
from memlm.storage.datastore import Datastore  # noqa: E402
from memlm.xu2023.generalized import train_learned_wds  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="name of the model in the results (e.g. smollm2, scratch)")
    add_forward_args(p, valid_tokens=10_000, test_tokens=20_000)
    p.add_argument("--datastore-att", required=True, help="datastore with ffn_in keys of the last layer")
    p.add_argument("--datastore-ffn", required=True, help="datastore with final keys")
    p.add_argument("--corpus", default="wiki", help="held-out text: its valid and test splits (e.g. wiki,news)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=512, help="W_ds training batch")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=20_000)
    p.add_argument("--roles", default="att,ffn", help="which W_ds to train (the JSON is written after each)")
    p.add_argument("--out", default="runs/learned_wds", help="forward-pass cache")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    t0 = time.perf_counter()
    out, model, tok, n_layers = open_run(args)
    paths = {"att": args.datastore_att, "ffn": args.datastore_ffn}
    stores = {r: Datastore.open(paths[r]) for r in args.roles.split(",")}
    specs = [ds.key_spec.normalized(n_layers) for ds in stores.values()]
    fw = {s: forward(args, model, tok, args.corpus, s, specs, out) for s in ("valid", "test")}
    del model
    result: dict = {"label": args.label, "config": vars(args), "roles": {}}
    result["command"] = "python benchmarks/papers/xu2023/learned_wds_curve.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    for (role, ds), spec in zip(stores.items(), specs, strict=True):
        (v_ts, v_q), (t_ts, t_q) = fw["valid"], fw["test"]
        vq, tq = v_q[spec], t_q[spec]
        # the kNN-LM with the same datastore, keys and similarity: exact IP search, τ = 1, λ tuned on valid
        knn = {}
        for split, ts, q in (("valid", v_ts, vq), ("test", t_ts, tq)):
            d = ts.select()
            add_neighbours(d, q, ds, k=args.k, search="exact", scores="exact", metric="ip", progress=False)
            knn[split] = d
        lam = fit_table(knn["valid"], "rule", [1.0]).rule_weights["knn"]  # λ by EM at τ = 1
        knn_row = {"lambda": lam, "temperature": 1.0, **perplexities(knn["test"], lam=lam, temperature=1.0)}
        vocab = int(ds.manifest["tokenizer"]["vocab_size"])
        log(f"{args.label}/{role}: kNN-LM (IP, τ = 1) {knn_row['base_ppl']:.3f} -> {knn_row['knn_ppl']:.3f}")
        t1 = time.perf_counter()

        head = {"key": spec.describe(n_layers), "knn_lm": knn_row, "partial": True}

        def partial(curve: list[dict], role: str = role, head: dict = head) -> None:  # the curve so far, if stopped
            result["roles"][role] = {**head, "curve": curve}
            atomic_write_json(args.json, result)

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        wds, curve = train_learned_wds(
            ds.keys, ds.values, vocab, n=1, metric="ip", epochs=10_000, batch_size=args.batch, lr=args.lr,
            max_steps=args.max_steps, dtype="bfloat16", valid=(vq, v_ts.targets), patience=args.patience,
            log_every=args.log_every, on_log=partial,
        )  # fmt: skip
        seconds = time.perf_counter() - t1
        row = interpolation_row(
            torch.from_numpy(v_ts.lm_logprob),
            wds.score(vq, v_ts.targets),
            torch.from_numpy(t_ts.lm_logprob),
            wds.score(tq, t_ts.targets),
        )
        best_step = curve[-1]["best_step"]
        result["roles"][role] = {
            "key": spec.describe(n_layers),
            "datastore": str(ds.path),
            "entries": len(ds),
            "vocab": vocab,
            "params": vocab * ds.dim,
            "knn_lm": knn_row,
            "learned": row,
            "share_of_knn_gain": gain_explained(row["base_ppl"], row["interp_ppl"], knn_row["knn_ppl"]),
            "curve": curve,
            "best_step": best_step,
            "stopped_at": curve[-1]["step"],
            "epochs_at_best": best_step * args.batch / len(ds),
            "plateaued": curve[-1]["step"] < args.max_steps,
            "train_seconds": seconds,
        }
        log(
            f"{args.label}/{role}: W_ds best at step {best_step} (stopped {curve[-1]['step']}), memory-only test ppl "
            f"{row['memory_ppl']:.3f}, interp {row['interp_ppl']:.3f} (λ={row['lambda']}), share "
            f"{result['roles'][role]['share_of_knn_gain']:.0%}"
        )
        result["seconds"] = time.perf_counter() - t0
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, result)  # after each role: a long run keeps what it finished
        plot(result, Path(args.json).with_suffix(".png"))
    log(f"done in {result['seconds']:.0f} s: {args.json}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for role, r in result["roles"].items():
        steps = [e["step"] for e in r["curve"]]
        ppl = [e["valid_ppl"] for e in r["curve"]]
        (line,) = ax.plot(steps, ppl, marker="o", ms=3, label=f"{role} ({r['key']})")
        ax.axvline(r["best_step"], color=line.get_color(), ls=":", lw=1)
        ax.axhline(r["learned"]["base_ppl"], color="grey", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("W_ds updates (batch 512)")
    ax.set_ylabel("memory-only perplexity, valid")
    ax.set_title(f"{result['label']}: learned W_ds until it plateaus (dotted: kept step; dashed: base LM test)")
    ax.title.set_fontsize(8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".tmp.png"), dpi=110)
    path.with_suffix(".tmp.png").replace(path)
    print(json.dumps({"plot": str(path)}))


if __name__ == "__main__":
    main()
