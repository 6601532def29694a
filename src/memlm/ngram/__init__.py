"""The ∞-gram LM (Liu, Min, Zettlemoyer, Choi, Hajishirzi 2024, "Infini-gram", arXiv 2401.17377) as a memlm memory.

A suffix array over the token ids of a reference corpus answers, for any context ``w_1 .. w_{i-1}``, the next-token
distribution of its longest suffix that occurs in the corpus (Sec. 3, Eq. 2)::

    P∞(w_i | w_1..w_{i-1}) = cnt(w_{i-(n-1)} .. w_{i-1} w_i) / cnt(w_{i-(n-1)} .. w_{i-1})
    n = max{ n' in [1, i] : cnt(w_{i-(n'-1)} .. w_{i-1}) > 0 }      (the "effective n": 1 + the suffix's words)

It needs no forward pass: building is tokenizing and sorting. Interpolated with a neural LM with one weight for
*sparse* estimates (one token has all the mass) and one for the others (Sec. 5)::

    P(w | c) = λ_s P∞(w | c) + (1 - λ_s) P_LM(w | c)   where P∞(· | c) is sparse, λ_d elsewhere

* :mod:`memlm.ngram.index`: ``memlm ngram build``: the model's tokenizer, memlm's own token and offset files, the
  suffix array from the ``infini-gram`` package's ``rust_indexing`` binary, a manifest (tokenizer fingerprint,
  sources, counts, checksums), lock, resume, held-out slice; :class:`~memlm.ngram.index.NgramIndex` opens one.
* :mod:`memlm.ngram.memory`: :class:`~memlm.ngram.memory.NgramMemory`: P∞ of every scored target (count, effective n,
  sparse flag) for whole documents at once, reusing the previous position's suffix; the next-token counts of a
  context (exact, also where the engine samples) for generation; one end-of-text rule for index and query.
* :mod:`memlm.ngram.mixture`: the interpolation (λ_sparse, λ_dense, with or without a kNN term; one pair per index
  when several are mixed), its tuning on a dump and the build's calibration.
* :mod:`memlm.ngram.decontaminate`: the paper's decontamination of the reference data (App. B: a document goes when
  >= 80% of its 13-grams occur in the evaluation text), applied by ``memlm ngram build`` and ``memlm demo`` before
  tokenizing, against the valid and test splits of every named corpus and the sets the user names.

Needs the optional extra ``pip install memlm[ngram]`` (``infini-gram``, Python >= 3.11). Modules are imported on use.
"""
