"""The spine of memlm: the one formula every method shares (Xu et al. 2023, Eq. 5) and what it needs.

    P(w|c) = (1-λ) · softmax(W_sm · h_sm)  +  λ · M · softmax( mask-to-k( W_ds ⊗ h_ds ) / τ )

* :mod:`memlm.core.distribution`: retrieved ``(scores, values)`` -> a distribution over values (softmax with
  temperature, per-value sum ``M``, counts of merged entries), interpolation, joint normalisation (TRIME), perplexity.
* :mod:`memlm.core.memory`: the ``Memory`` protocol, ``search(queries, k) -> Retrieved(scores, values, ids)``, and
  its implementations over a datastore + FAISS index, exact search and a dense ``W_ds``.
* :mod:`memlm.core.config`: ``RetrievalConfig``, the settings recorded in every dump and result file.
* :mod:`memlm.core.tuning`: one grid search for λ, τ, cache weights and per-method parameters.
* :mod:`memlm.core.dumps`: one per-token dump format (``.npz`` arrays + JSON meta) for every method.

Nothing here imports a model, a corpus or a method package: methods (``knnlm``, ``trime``, ``npm``, the Xu et al.
analysis) import the core, never the other way round.
"""
