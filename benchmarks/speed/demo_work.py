"""What ``memlm demo`` computes on a first run, phase by phase, before and after issue 34's demo changes: forward
tokens of each datastore build (keys only) and of each scored split (with the output projection), scored tokens, and
the query x key pairs of each exact search. Counted with the tokenizer (:func:`memlm.experiments.demo.planned_work`),
no forward pass, so it may run on a busy machine; the demo itself records the same counts with its seconds in its
``results.json`` (``work``)::

    PYTHONPATH=src python benchmarks/speed/demo_work.py --out docs/results/speed/demo_work.json

"before" is session 37's configuration (docs/results/demo_fresh_home_session37.log: 50k-token datastores, valid
4,000 tokens, the splits scored in windows of 512 overlapping by 128; quick: 12k, 1,000, 256 / 64), "after" today's
:class:`~memlm.experiments.demo.DemoConfig` and ``DemoConfig.quick()``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from memlm.experiments.demo import DemoConfig, planned_work, work_totals
from memlm.io.fileio import atomic_write_json
from memlm.models.resources import load_causal_lm

BEFORE = {"datastore_tokens": 50_000, "valid_tokens": 4_000, "eval_blocks": False}
BEFORE_QUICK = {"datastore_tokens": 12_000, "valid_tokens": 1_000, "eval_blocks": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    _, tok = load_causal_lm("smollm2-135m", dtype="float32")
    configs = {
        "full before": dataclasses.replace(DemoConfig(), **BEFORE),
        "full after": DemoConfig(),
        "quick before": dataclasses.replace(DemoConfig.quick(), **BEFORE_QUICK),
        "quick after": DemoConfig.quick(),
    }
    result = {}
    for name, cfg in configs.items():
        work = planned_work(cfg, tok)
        t = {**work_totals(work), "forward": 0}
        t["forward"] = t["datastores"] + t["scoring"]
        result[name] = {"config": dataclasses.asdict(cfg), "phases": work, "totals": t}
        print(
            f"{name:13s} forward tokens {t['forward']:7,d} (datastores {t['datastores']:,}, scoring "
            f"{t['scoring']:,} for {t['scored']:,} scored); search {t['search_pairs'] / 1e6:,.0f}M pairs"
        )
        for w in work:
            what = (f"{w['forward_tokens']:,} forward tokens, {w['targets']:,} targets" if "forward_tokens" in w
                    else f"{w['search_pairs'] / 1e6:,.1f}M query x key pairs")  # fmt: skip
            print(f"    {w['phase']:28s} {what}")
    atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
