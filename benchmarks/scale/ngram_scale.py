"""An ∞-gram index of 10^9 tokens, built and queried (docs/results/ngram.md, "At a billion tokens"): what 2 cores
cannot hold.

    python benchmarks/scale/ngram_scale.py prepare --index IDX --out .dev/scale  # here: real tokens + test queries
    python benchmarks/scale/ngram_scale.py run --data .dev/scale --tokens 1000000000 --work runs/w --out OUT.json

``prepare`` copies the token file of a built index (all six offline train splits, 15.06M SmolLM2 tokens), its
tokenizer identity, and the first ``--test-tokens`` WikiText-2 test tokens as query documents. ``run`` (on the
machine that has the disk and cores) then

1. indexes the real tokens as they are (the same-machine baseline), and
2. synthesizes ``--tokens`` tokens as random spans of the real stream (span length geometric, mean ``--span``,
   documents of ``--doc-len`` tokens): n-grams up to a span's length occur as in real text, about
   ``tokens / 15.06M`` times as often; longer contexts than a span are rarer than in real text of that size, so
   effective n is lower and the latency per query at most what real text of that size gives for the walk,
   and indexes it,

each with the suffix-array step of ``memlm ngram build`` (``memlm.ngram.index._suffix_array``: the package's
``rust_indexing``, make-part / merge / concat) and memlm's manifest, then opens it with ``NgramMemory`` and times
the walk, cold queries and next-token distributions as ``ngram_cost.py query`` does. The JSON is rewritten after
each part. Tokenizing is not part of this (the tokens are synthesized): its rate is the 2-core figure of
``ngram_cost.py build``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "papers" / "ngram")]
from ngram_cost import _write, time_memory  # noqa: E402
from protocol import peak_rss_mib  # noqa: E402

SEP = 0xFFFF


def prepare(args: argparse.Namespace) -> None:
    from memlm.data.corpora import load_documents
    from memlm.data.windows import limit_documents, tokenize_documents
    from memlm.models.resources import load_causal_lm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = Path(args.index)
    manifest = json.loads((index / "manifest.json").read_text())
    if manifest["token_dtype"] != "u16":
        raise SystemExit("prepare expects a u16 index")
    shutil.copyfile(index / "tokenized.0", out / "real_tokens.u16")
    _, tok = load_causal_lm(args.model, dtype="float32")
    docs = limit_documents(load_documents("wikitext2", "test"), tok, args.test_tokens)
    chunks = [np.asarray(c.tokens, dtype=np.int64) for c in tokenize_documents(docs, tok)]
    np.savez(out / "test_chunks.npz", *chunks)
    info = {"tokenizer": manifest["tokenizer"], "source_index": str(index), "source": manifest["sources"][0],
            "test_tokens": int(sum(len(c) for c in chunks))}  # fmt: skip
    (out / "prepared.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))


def _write_shard(folder: Path, blocks) -> dict:
    """tokenized.0 from ``blocks`` (uint16 arrays that already hold the separators), then offset / metadata files;
    returns the shard record ``_publish`` reads."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tokenized.0", "wb") as f:
        for b in blocks:
            f.write(np.ascontiguousarray(b, dtype=np.uint16).tobytes())
    tokens = np.memmap(folder / "tokenized.0", dtype=np.uint16, mode="r")
    starts = np.flatnonzero(tokens == SEP).astype(np.uint64)
    (folder / "offset.0").write_bytes((starts * 2).tobytes())
    lines = [(json.dumps({"id": f"doc-{i}"}) + "\n").encode() for i in range(len(starts))]
    lengths = np.fromiter((len(x) for x in lines), dtype=np.uint64, count=len(lines))
    (folder / "metadata.0").write_bytes(b"".join(lines))
    (folder / "metaoff.0").write_bytes((np.cumsum(lengths) - lengths).tobytes())
    return {"tokenized": len(tokens) * 2, "offset": len(starts) * 8, "metadata": int(lengths.sum()),
            "metaoff": len(starts) * 8, "tokens": len(tokens), "documents": len(starts), "sorted": True}  # fmt: skip


def _synthetic_blocks(real: np.ndarray, total: int, span: float, doc_len: int, seed: int, block: int = 1 << 26):
    """``total`` tokens of random spans of ``real`` (separators removed), in documents of ``doc_len`` tokens, each
    after a separator; yielded ``block`` tokens at a time."""
    rng = np.random.default_rng(seed)
    flat = real[real != SEP]
    made = 0
    while made < total:
        n = min(block, total - made)
        n -= n % doc_len
        if n <= 0:
            break
        lengths = np.minimum(rng.geometric(1.0 / span, size=int(2 * n / span) + 16), 4 * int(span))
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), n) + 1]
        lengths[-1] -= lengths.sum() - n
        lengths = lengths[lengths > 0]
        starts = rng.integers(0, len(flat) - lengths.max(), size=len(lengths))
        idx = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(n)
        docs = flat[idx].reshape(-1, doc_len)
        yield np.hstack([np.full((len(docs), 1), SEP, dtype=np.uint16), docs]).ravel()
        made += n


def _index(folder: Path, shard: dict, ident: dict, source: dict, cpus: int, memory_gb: float) -> dict:
    from memlm.ngram.index import _publish, _suffix_array, rust_indexing

    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    _suffix_array(rust_indexing(), folder, 0, 2, memory_gb, cpus, True)
    sa_seconds = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    config = {"tokenizer": ident["fingerprint"], "token_dtype": "u16", "shard_tokens": None, "source": source}
    t0 = time.perf_counter()
    index = _publish(folder, {"shards": [shard]}, ident, "u16", config, sa_seconds)
    m = index.manifest
    return {"tokens": m["tokens"], "documents": m["documents"], "suffix_array_seconds": sa_seconds,
            "suffix_array_tokens_per_second": m["tokens"] / sa_seconds,
            "suffix_array_cpu_seconds": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
            "builder_peak_rss_mib": c1.ru_maxrss / 1024, "publish_seconds": time.perf_counter() - t0,
            "bytes": m["bytes"], "bytes_per_token": m["bytes_per_token"],
            "files": {k: v["bytes"] for k, v in m["files"].items()}}  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from memlm.ngram.memory import NgramMemory

    data, work, out_path = Path(args.data), Path(args.work), Path(args.out)
    info = json.loads((data / "prepared.json").read_text())
    real = np.fromfile(data / "real_tokens.u16", dtype=np.uint16)
    npz = np.load(data / "test_chunks.npz")
    chunks = [npz[k] for k in sorted(npz.files, key=lambda k: int(k.split("_")[1]))]
    cpus = args.cpus or os.cpu_count() or 1
    out: dict = {"command": " ".join(["python", *sys.argv]), "machine": {"cpus": cpus, "node": os.uname().nodename},
                 "query_tokens": int(sum(len(c) for c in chunks)), "indexes": {}}  # fmt: skip
    plans = [("real-15m", None), (f"synthetic-{args.tokens:.0e}".replace("+", ""), args.tokens)]
    for name, total in plans:
        folder = work / name
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        if total is None:
            shard = _write_shard(folder, [real])
            source = {"corpus": info["source"]["corpus"], "split": "train", "note": "the real token file"}
        else:
            shard = _write_shard(folder, _synthetic_blocks(real, total, args.span, args.doc_len, args.seed))
            source = {"corpus": "synthetic", "note": f"random spans (geometric, mean {args.span}) of "
                      f"{info['source']['corpus']} train, documents of {args.doc_len}", "seed": args.seed}  # fmt: skip
        write_seconds = time.perf_counter() - t0
        rec = {"write_token_files_seconds": write_seconds, **_index(folder, shard, info["tokenizer"], source, cpus,
                                                                     args.memory_gb)}  # fmt: skip
        out["indexes"][name] = rec
        _write(out_path, out)
        print(name, json.dumps(rec), flush=True)
        memory = NgramMemory(folder)
        rec["queries"] = time_memory(memory, chunks, args.queries, np.random.default_rng(0), idle_wait=args.idle_wait)
        rec["process_peak_rss_mib"] = peak_rss_mib()
        _write(out_path, out)
        print(name, json.dumps(rec["queries"]), flush=True)
        del memory
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--index", required=True)
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--test-tokens", type=int, default=20000)
    a.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--tokens", type=int, default=10**9)
    r.add_argument("--span", type=float, default=32.0)
    r.add_argument("--doc-len", type=int, default=1024)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--queries", type=int, default=1000)
    r.add_argument("--cpus", type=int, default=None)
    r.add_argument("--memory-gb", type=float, default=64.0)
    r.add_argument("--idle-wait", type=float, default=30.0)
    r.add_argument("--keep", action="store_true")
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    args = p.parse_args()
    {"prepare": prepare, "run": run}[args.cmd](args)


if __name__ == "__main__":
    main()
