"""Training throughput of memlm's trainer vs a bare PyTorch loop over the same model and batches (target >= 0.9x).

Both train the same randomly initialised GPT-2 (``--arch``, BPE vocabulary size ``--vocab``) on the same random token
batches with AdamW under bf16 autocast. The bare loop is ``loss = model(input_ids, labels=input_ids).loss;
loss.backward(); opt.step(); opt.zero_grad()``; memlm's is :func:`memlm.training.loop.train` (LR schedule, gradient
clipping, logging; checkpoints and validation off). The two alternate ``--repeats`` times and the best tokens/s of each
is kept (warm-up updates excluded). With ``--losses`` it also times TRIME's objectives (Zhong et al. 2022) in the same
trainer on the same model and tokens, against memlm's plain cross-entropy: ``trime`` (local memory), ``trime-long``
(rows are ``--segments-per-doc`` consecutive segments of one document) and ``trime-ext`` (every other row is memory;
local memory dropped with p = 0.9).

    PYTHONPATH=src python benchmarks/speed/bench_train.py --json docs/results/train_throughput.json
    PYTHONPATH=src python benchmarks/speed/bench_train.py --arch 4x256 --losses trime,trime-long,trime-ext \
        --json docs/results/trime_train_throughput.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from memlm.training.loop import TrainConfig, parse_arch, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protocol import machine, save_result  # noqa: E402


def make_model(arch: str, vocab: int, seq_len: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head = parse_arch(arch)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    return GPT2LMHeadModel(cfg)


def bare_loop(model, batches: list[torch.Tensor], warmup: int) -> float:
    """Tokens/s of the plain loop after ``warmup`` updates."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model.train()
    t0, tokens = None, 0
    for i, x in enumerate(batches):
        if i == warmup:
            t0, tokens = time.perf_counter(), 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
    return tokens / (time.perf_counter() - t0)


def memlm_loop(model, batches: list[torch.Tensor], warmup: int, loss_fn=None, wrap=None) -> float:
    """Tokens/s of :func:`memlm.training.loop.train` after ``warmup`` updates (wall clock of the updates, from its
    log)."""
    cfg = TrainConfig(max_steps=len(batches), batch_size=batches[0].shape[0], seq_len=batches[0].shape[1])
    cfg.dtype, cfg.lr = "bfloat16", 3e-4
    data = [wrap(x) if wrap else {"input_ids": x} for x in batches]
    kwargs = {"loss_fn": loss_fn, "warmup_loss": None} if loss_fn is not None else {}
    with tempfile.TemporaryDirectory() as out:
        res = train(model, cfg, data, None, out_dir=out, progress=False, **kwargs)
    log = res.log[warmup:]
    seconds = sum(batches[0].numel() / e["tokens_per_s"] for e in log)
    return len(log) * batches[0].numel() / seconds


def trime_fields(name: str, batch_size: int, segments_per_doc: int):
    """Extra batch fields of a TRIME objective for a batch of ``batch_size`` rows (see memlm.trime.training)."""
    rows = torch.arange(batch_size)
    if name == "trime-long":  # groups of m consecutive segments of one document
        return {"segment_doc": rows // segments_per_doc, "segment_index": rows % segments_per_doc}
    return {"segment_doc": rows, "segment_index": torch.zeros_like(rows)}


def time_losses(args, batches: list[torch.Tensor]) -> dict[str, float]:
    """Best tokens/s of memlm's trainer with each of ``args.losses`` (plus ``ce``) on the same model and tokens."""
    from memlm.trime.training import trime_objective

    best: dict[str, float] = {}
    names = ["ce", *[n for n in args.losses.split(",") if n and n != "ce"]]
    for _ in range(args.repeats):
        for name in names:
            setup = trime_objective(name, seq_len=args.seq_len, batch_size=args.batch_size)
            fields = trime_fields(name, args.batch_size, args.segments_per_doc)
            tps = memlm_loop(
                make_model(args.arch, args.vocab, args.seq_len),
                batches,
                args.warmup,
                loss_fn=setup.loss_fn,
                wrap=lambda x, f=fields: {"input_ids": x, **f},
            )
            best[name] = max(best.get(name, 0.0), tps)
            print(f"{name:12s} {tps:.0f} tok/s", file=sys.stderr)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="6x384")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--losses", default="", help="also time these TRIME objectives, e.g. trime,trime-long,trime-ext")
    p.add_argument("--segments-per-doc", type=int, default=4, help="trime-long: consecutive segments per document")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(args.steps)]
    bare, ours = [], []
    for _ in range(args.repeats):
        bare.append(bare_loop(make_model(args.arch, args.vocab, args.seq_len), batches, args.warmup))
        ours.append(memlm_loop(make_model(args.arch, args.vocab, args.seq_len), batches, args.warmup))
        print(f"bare {bare[-1]:.0f} tok/s   memlm {ours[-1]:.0f} tok/s", file=sys.stderr)
    result = {
        "command": "PYTHONPATH=src python benchmarks/speed/bench_train.py " + " ".join(argv or sys.argv[1:]),
        "arch": args.arch,
        "vocab": args.vocab,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "timed_updates": args.steps - args.warmup,
        "bare_tokens_per_s": max(bare),
        "memlm_tokens_per_s": max(ours),
        "ratio": max(ours) / max(bare),
        "all_bare": bare,
        "all_memlm": ours,
        "machine": machine(),
    }
    if args.losses:
        per_loss = time_losses(args, batches)
        result["loss_tokens_per_s"] = per_loss
        result["loss_ratio_vs_ce"] = {k: v / per_loss["ce"] for k, v in per_loss.items()}
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("all_")}, indent=2))
    save_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
