"""The learned mixture over the LM and any number of memories, generic over the memory kinds: a per-token dump's
components and features (``inputs``), the mixture fitted on a dump, stored and applied beside the fixed-weight rule
(``dump``), and one step of the mixture over the vocabulary (``step``). The kNN-LM and the ∞-gram both build on it.

Modules are imported on use: ``from memlm.mixing.report import fit_table``."""
