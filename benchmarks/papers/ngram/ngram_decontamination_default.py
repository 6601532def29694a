"""What `memlm ngram build`'s default decontamination drops from the six offline train splits (docs/results/ngram.md,
"Decontamination"): the documents of ``--corpus`` that the infini-gram paper's rule (Liu et al. 2024, App. B) finds in
the valid and test splits of every named corpus, the sets the build chooses by default.

    python benchmarks/papers/ngram/ngram_decontamination_default.py \\
        --out docs/results/ngram/decontamination_default_valid_test.json

The same call as the build (:func:`memlm.ngram.decontaminate.decontamination_sets` and
:func:`~memlm.ngram.decontaminate.decontaminate_reference`, SmolLM2's tokenizer for the dropped tokens), without the
indexing; the record is what the build writes into its manifest.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from transformers import AutoTokenizer

from memlm.data.corpora import load_documents
from memlm.io.fileio import atomic_write_json
from memlm.ngram.decontaminate import decontaminate_reference, decontamination_sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="wiki,news,brown,bbc,wikitext2,imdb")
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache/memlm/models/smollm2-135m"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    docs = [d for c in args.corpus.split(",") for d in load_documents(c, "train")]
    names = decontamination_sets(args.corpus, "train", None)
    t0 = time.perf_counter()
    kept, record = decontaminate_reference(docs, names, tok)
    atomic_write_json(
        Path(args.out),
        {
            "command": "python benchmarks/papers/ngram/ngram_decontamination_default.py "
            f"--corpus {args.corpus} --out {args.out}",
            "corpus": args.corpus,
            "sets": names,
            "train_documents": len(docs),
            "kept_documents": len(kept),
            "decontamination": record,
            "seconds_shared_machine": time.perf_counter() - t0,
        },
    )
    print(f"{args.out}: dropped {record['dropped_documents']} of {len(docs)} documents against {', '.join(names)}")


if __name__ == "__main__":
    main()
