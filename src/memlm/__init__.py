"""memlm: memory-augmented (nonparametric) language models on any Hugging Face model."""

from memlm.errors import MemlmError

__all__ = ["MemlmError"]
__version__ = "0.1.0"
