"""Key types of the last layer beside Khandelwal et al. (2020) Table 5: one table, every key type of the paper.

    python benchmarks/papers/knnlm/key_types.py --out runs/key_types --json docs/results/key_types/key_types.json

Table 5 of the paper ("Wikitext-103 validation results using different states from the final layer of the LM as the
representation function for keys and queries. We retrieve k = 1024 neighbors and λ is tuned for each") compares six
states of the last Transformer layer. Each maps to a memlm key role (``memlm.models.keys``), found from the model's
module structure:

=====================================  ===================  =====================================================
paper (Table 5)                        memlm key            what it is in a pre-LN decoder (SmolLM2 = Llama)
=====================================  ===================  =====================================================
Model output                           ``block_out@-1``     the last layer's output (residual stream), before the
                                                            final norm
Model output layer normalized          ``final``            after the final norm: what the output softmax reads
FFN input after layer norm             ``ffn_in@-1``        the FFN sublayer's input after its norm (the default)
FFN input before layer norm            ``ffn_in_raw@-1``    the residual stream entering the FFN sublayer
MHSA input after layer norm            ``attn_in@-1``       the self-attention's input after its norm
MHSA input before layer norm           ``block_out@-2``     the residual stream entering the last layer
=====================================  ===================  =====================================================

Protocol: one datastore per key over the same wiki-train text (same windows, same targets), exact search (``Flat``,
squared L2, as the paper's full-precision rescoring), k = 1024. For every key two rows: the paper's protocol
(τ = 1: Eq. 2 with raw negative squared distances, λ tuned on valid) and λ and τ both tuned on valid. Valid and test
perplexity of each are reported (the paper's Table 5 is on validation). One forward pass over each evaluation split
captures all six query types. Every stage is cached under --out, so a rerun resumes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from knnlm_sweeps import add_forward_args, datastore, forward, log, neighbours, open_run  # noqa: E402

from memlm.core.tuning import DEFAULT_TEMPERATURES
from memlm.io.fileio import atomic_write_json  # noqa: E402
from memlm.knnlm.evaluate import perplexities  # noqa: E402
from memlm.mixing.report import fit_summary, fit_table  # noqa: E402
from memlm.models.keys import KeySpec  # noqa: E402

# (paper row, memlm key, paper's Wikitext-103 dev perplexity)
KEY_TYPES: list[tuple[str, str, float]] = [
    ("Model output", "block_out@-1", 17.07),
    ("Model output layer normalized", "final", 17.01),
    ("FFN input after layer norm", "ffn_in@-1", 16.06),
    ("FFN input before layer norm", "ffn_in_raw@-1", 17.06),
    ("MHSA input after layer norm", "attn_in@-1", 16.76),
    ("MHSA input before layer norm", "block_out@-2", 17.14),
]
PAPER_NO_DATASTORE = 17.96
# memlm's default grid widened upwards: keys before a norm (the residual stream) choose τ = 20,000 here, beyond the
# default grid's top (1,000)
TEMPERATURES = sorted({*DEFAULT_TEMPERATURES, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/key_types")
    p.add_argument("--json", default="docs/results/key_types/key_types.json")
    add_forward_args(p, valid_tokens=10_000, test_tokens=20_000)
    p.add_argument("--datastore-tokens", type=int, default=100_000, help="wiki train tokens per datastore")
    args = p.parse_args()
    t0 = time.perf_counter()
    out, model, tok, n_layers = open_run(args)
    specs = [KeySpec.parse(key).normalized(n_layers) for _, key, _ in KEY_TYPES]
    fw = {s: forward(args, model, tok, "wiki", s, specs, out) for s in ("valid", "test")}
    rows = []
    for (paper_row, _key, paper_ppl), spec in zip(KEY_TYPES, specs, strict=True):
        name = spec.describe(n_layers).replace("@", "-")
        t1 = time.perf_counter()
        ds = datastore(args, model, tok, "wiki", spec, args.datastore_tokens, out / f"ds-{name}")
        build_s = time.perf_counter() - t1
        v, t = (neighbours(*fw[s], ds, args.k, out / f"nb-{s}-{name}.npz") for s in ("valid", "test"))
        row = {"paper_row": paper_row, "key": spec.describe(n_layers), "paper_dev_ppl": paper_ppl,
               "entries": len(ds), "dim": ds.dim, "seconds_build_and_index": build_s}  # fmt: skip
        for label, temps in (("tau1", [1.0]), ("tuned", None)):
            best = fit_summary(fit_table(v, "rule", temps or TEMPERATURES))  # λ by EM at each τ, the most likely
            lam, tau = best["knn"], best["temperature"]
            row[label] = {
                "lambda": lam,
                "temperature": tau,
                "temperature_at_grid_edge": bool(temps is None and tau in (TEMPERATURES[0], TEMPERATURES[-1])),
                "valid": perplexities(v, lam=lam, temperature=tau),
                "test": perplexities(t, lam=lam, temperature=tau),
            }
        rows.append(row)
        log(
            f"{paper_row} ({row['key']}): valid {row['tau1']['valid']['base_ppl']:.3f} -> τ=1 "
            f"{row['tau1']['valid']['knn_ppl']:.3f}, tuned {row['tuned']['valid']['knn_ppl']:.3f} "
            f"(λ={row['tuned']['lambda']}, τ={row['tuned']['temperature']})"
        )
    result = {
        "what": "Khandelwal et al. (2020) Table 5 key types on SmolLM2-135M: one datastore per key over the same "
        "wiki-train text, Flat (exact L2), k = 1024; λ tuned on valid at τ = 1 (the paper's protocol) and λ, τ tuned",
        "command": f"python benchmarks/papers/knnlm/key_types.py --out {args.out} --json {args.json}"
        + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "json")),
        "config": vars(args),
        "temperature_grid": TEMPERATURES,
        "paper": {"no_datastore_dev_ppl": PAPER_NO_DATASTORE, "rows": {r: ppl for r, _, ppl in KEY_TYPES}},
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, result)
    print(table(result))
    log(f"done in {result['seconds']:.0f} s: {args.json}")


def table(result: dict) -> str:
    """Markdown: one row per key type, paper beside ours (valid and test; τ = 1 and tuned)."""
    base_v = result["rows"][0]["tau1"]["valid"]["base_ppl"]
    base_t = result["rows"][0]["tau1"]["test"]["base_ppl"]
    lines = [
        "| key type (Table 5) | memlm key | paper dev ppl | valid, τ = 1 | test, τ = 1 | λ (τ = 1) | valid, tuned | "
        "test, tuned | λ, τ (tuned) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
        f"| no datastore | - | {result['paper']['no_datastore_dev_ppl']:.2f} | {base_v:.3f} | {base_t:.3f} | - | "
        f"{base_v:.3f} | {base_t:.3f} | - |",
    ]
    for r in result["rows"]:
        a, b = r["tau1"], r["tuned"]
        lines.append(
            f"| {r['paper_row']} | `{r['key']}` | {r['paper_dev_ppl']:.2f} | {a['valid']['knn_ppl']:.3f} | "
            f"{a['test']['knn_ppl']:.3f} | {a['lambda']} | {b['valid']['knn_ppl']:.3f} | {b['test']['knn_ppl']:.3f} | "
            f"{b['lambda']}, {b['temperature']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
