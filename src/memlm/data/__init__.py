"""Data: named corpora (document-level splits, fingerprints) and the sliding windows over their tokens."""
