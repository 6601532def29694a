"""The kNN-LM (Khandelwal et al. 2020) and its efficiency methods.

* :mod:`memlm.knnlm.prune`: datastore pruning by greedy merging, with counts (He et al. 2021, Sec. 5.2).
* :mod:`memlm.knnlm.adaptive`: adaptive retrieval, a gate on the LM's own distribution that predicts λ and skips the
  search where it is small (He et al. 2021, Sec. 4).
* :mod:`memlm.knnlm.pointer`: pointer reuse, RetoMaton's automaton over the datastore that follows the successors of
  the entries just retrieved instead of searching again (Alon et al. 2022).

Modules are imported on use: ``from memlm.knnlm.prune import prune_datastore``.
"""
