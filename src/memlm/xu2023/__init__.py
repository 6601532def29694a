"""Xu, Alon & Neubig 2023, "Why do Nearest Neighbor Language Models Work?": the generalized kNN-LM (Eq. 5) as
tensors, the learned ``W_ds`` (Sec. 4) and the ablation grid of `memlm analyze` (Tables 1-3, Figs. 2-5)."""
