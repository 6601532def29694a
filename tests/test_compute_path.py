"""Compute paths (memlm.models.compute): each fast path's keys match float32's within the stated error, keys by role
are still captured after quantization and compile, the LM log-softmax stays float32, and a datastore built on one path
is checked when queried on another."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import gpt2_tokenizer, make_toy_docs
from transformers import AutoModelForCausalLM, LlamaConfig

from memlm.errors import MemlmError
from memlm.models import compute, cpu
from memlm.models.compute import (
    KEY_ERROR,
    KEY_TOLERANCE,
    ComputePath,
    apply_compute_path,
    check_compute_paths,
    describe_compute_path,
    relative_key_error,
)
from memlm.models.forward import forward_windows
from memlm.models.keys import KEY_ROLES, KeyCapture, KeySpec, key_module_name
from memlm.models.resources import model_fingerprint


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0):
    """A 2-layer, 64-wide Llama (nn.Linear projections, like SmolLM2) with random weights, GPT-2's vocabulary."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50257, max_position_embeddings=512)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.config.memlm_name = f"tiny-llama-seed{seed}"
    return model.to(dtype)


IDS = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(1))


def keys_of(model, roles=KEY_ROLES) -> dict[str, np.ndarray]:
    specs = [KeySpec(r, -1) for r in roles]
    with torch.inference_mode(), KeyCapture(model, specs) as cap:
        model(input_ids=IDS, use_cache=False)
        return {s.role: cap.keys_by_spec[s].float().reshape(-1, cap.keys_by_spec[s].shape[-1]).numpy() for s in specs}


def test_relative_key_error_is_the_norm_ratio():
    ref = np.array([[3.0, 4.0], [1.0, 0.0]])
    got = np.array([[3.0, 4.5], [1.0, 0.0]])
    assert relative_key_error(got, ref) == pytest.approx([0.1, 0.0])
    with pytest.raises(MemlmError, match="cannot be compared"):
        relative_key_error(got[:1], ref)


def test_eager_attention_keys_match_sdpa():
    model = tiny_llama()
    ref = keys_of(model)
    eager = apply_compute_path(tiny_llama(), ComputePath("float32", "eager"))
    assert eager.config._attn_implementation == "eager"
    got = keys_of(eager)
    for role in KEY_ROLES:
        assert relative_key_error(got[role], ref[role]).max() < 1e-5, role


def test_bf16_keys_within_the_stated_error():
    ref = keys_of(tiny_llama())
    got = keys_of(apply_compute_path(tiny_llama(torch.bfloat16), ComputePath("bfloat16")))
    for role in KEY_ROLES:
        e = relative_key_error(got[role], ref[role])
        assert 0 < np.percentile(e, 99) <= KEY_ERROR[("bfloat16", "none")], role


def test_int8_dynamic_keeps_keys_by_role_the_head_and_the_fingerprint():
    fp32 = tiny_llama()
    ref = keys_of(fp32)
    q = tiny_llama()
    fingerprint = model_fingerprint(q)
    apply_compute_path(q, ComputePath("float32", quantize="int8-dynamic"))
    quantized = [m for m in q.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down of each layer
    assert isinstance(q.get_output_embeddings(), torch.nn.Linear)  # the head stays float32
    assert model_fingerprint(q) == fingerprint  # the weights it was loaded with
    assert "mlp" in key_module_name(q, KeySpec("ffn_in", -1))
    got = keys_of(q)
    for role in KEY_ROLES:
        e = relative_key_error(got[role], ref[role])
        assert 0 < np.percentile(e, 99) <= KEY_ERROR[("float32", "int8-dynamic")], role
    # the LM log-probabilities are float32 and close to float32's
    from memlm.data.windows import Window

    w = Window(index=0, input_ids=IDS[0].numpy(), score_from=1, doc_hash=np.zeros(40, np.uint64),
               offset=np.arange(40, dtype=np.int64), doc_index=np.zeros(40, np.int32))  # fmt: skip
    (a,) = next(forward_windows(fp32, [[w]], [KeySpec()]))
    (b,) = next(forward_windows(q, [[w]], [KeySpec()]))
    assert b.lm_logprob.dtype == np.float32
    assert np.abs(a.lm_logprob - b.lm_logprob).max() < 0.05


def test_int8_needs_float32_and_unknown_parts_are_refused():
    with pytest.raises(MemlmError, match="--dtype float32"):
        ComputePath("bfloat16", quantize="int8-dynamic")
    with pytest.raises(MemlmError, match="unknown --attention"):
        ComputePath("float32", attention="flash")
    with pytest.raises(MemlmError, match="loaded in float32"):
        apply_compute_path(tiny_llama(), ComputePath("bfloat16"))


@pytest.mark.slow
def test_compiled_blocks_keep_hooks_and_keys():
    """torch.compile (inductor) of each layer's attention and FFN: keys by role as in eager float32."""
    model = tiny_llama()
    ref = keys_of(model)
    try:
        compiled = apply_compute_path(tiny_llama(), ComputePath("float32", compile="inductor"))
        got = keys_of(compiled)
    except Exception as e:  # noqa: BLE001 - no C++ toolchain: the option is optional
        pytest.skip(f"torch.compile unavailable here: {e}")
    for role in KEY_ROLES:
        assert relative_key_error(got[role], ref[role]).max() < 1e-4, role
    assert describe_compute_path(compiled)["compile"] == "inductor"


def test_paths_within_tolerance_are_allowed_and_past_it_refused():
    f32 = {"dtype": "float32", "attention": "sdpa", "compile": "none", "quantize": "none"}
    bf16 = {**f32, "dtype": "bfloat16"}
    int8 = {**f32, "quantize": "int8-dynamic"}
    check_compute_paths(f32, bf16, "ds")
    check_compute_paths(bf16, bf16, "ds")
    check_compute_paths({"dtype": "bfloat16"}, f32, "ds")  # a manifest from before paths were recorded
    check_compute_paths(None, int8, "ds")
    check_compute_paths(int8, int8, "ds")  # the same arithmetic
    assert KEY_ERROR[("bfloat16", "none")] <= KEY_TOLERANCE < KEY_ERROR[("float32", "int8-dynamic")]
    with pytest.raises(MemlmError, match="float32\\+sdpa\\+int8-dynamic.*float32\\+sdpa"):
        check_compute_paths(int8, f32, "ds")
    with pytest.raises(MemlmError, match="over the 0.05 allowed"):
        check_compute_paths({**f32, "dtype": "float16"}, bf16, "ds")
    with pytest.raises(MemlmError, match="no measured key error"):
        check_compute_paths({"dtype": "float16", "quantize": "int8-dynamic"}, f32, "ds")


def test_datastore_records_its_path_and_checks_queries(tmp_path):
    from memlm.knnlm.write import write_datastore
    from memlm.storage.datastore import Datastore

    tok = gpt2_tokenizer()
    docs = make_toy_docs(6)
    built = write_datastore(tiny_llama(), tok, docs, tmp_path / "ds", window=32, min_context=8, progress=False)
    recorded = Datastore.open(tmp_path / "ds").manifest["build"]["compute_path"]
    assert (recorded["dtype"], recorded["attention"], recorded["quantize"]) == ("float32", "sdpa", "none")
    assert recorded["torch"] == torch.__version__ and recorded["key_error"] == 0.0
    built.check_compatible(apply_compute_path(tiny_llama(torch.bfloat16), ComputePath("bfloat16")), tok)
    built.check_compatible(apply_compute_path(tiny_llama(), ComputePath("float32", "eager")), tok)
    int8 = apply_compute_path(tiny_llama(), ComputePath("float32", quantize="int8-dynamic"))
    with pytest.raises(MemlmError, match="built on compute path float32\\+sdpa, this query runs on .*int8"):
        built.check_compatible(int8, tok)


def test_cpu_flags_reads_the_features_it_names(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 sse\n")
    real = cpu.Path
    monkeypatch.setattr(cpu, "Path", lambda p: info if p == "/proc/cpuinfo" else real(p))
    assert cpu.cpu_flags() == ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]


def test_bf16_products_head_only_with_amx_and_recorded(monkeypatch):
    """The bf16-products head is chosen only on a CPU with AMX-BF16 (not on AVX512-BF16 alone), never for a float32
    body, can be turned off with MEMLM_BF16_HEAD=0, and the manifest's compute path says which head ran."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(compute, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    assert not compute.bf16_products_available(cpu)
    assert describe_compute_path(tiny_llama(torch.bfloat16))["head"] == "float32"
    monkeypatch.setattr(compute, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16", "amx_bf16"])
    assert compute.bf16_products_available(cpu) == bool(torch.backends.mkldnn.is_available())
    if not compute.bf16_products_available(cpu):
        pytest.skip("this torch has no oneDNN")
    assert not compute.bf16_products_available(torch.device("meta"))
    assert describe_compute_path(tiny_llama(torch.bfloat16))["head"] == "bf16-products"
    assert describe_compute_path(tiny_llama())["head"] == "float32"
    monkeypatch.setenv("MEMLM_BF16_HEAD", "0")
    assert not compute.bf16_products_available(cpu)
    assert describe_compute_path(tiny_llama(torch.bfloat16))["head"] == "float32"


@pytest.mark.parametrize(
    "flags, device, dtype, emulated",
    [
        (["avx2"], "cpu", torch.bfloat16, True),  # AVX2 alone (the 2-core EPYC): bf16 measured ~7x slower
        (["avx2", "avx512f", "avx512_bf16"], "cpu", torch.bfloat16, False),  # native bf16 products, if not fast
        (["avx2", "avx512f", "amx_bf16"], "cpu", torch.bfloat16, False),
        (["bf16", "i8mm"], "cpu", "bfloat16", False),  # Arm's BF16 extension
        (["avx2"], "cpu", torch.float32, False),
        (["avx2"], "meta", torch.bfloat16, False),  # not a CPU: the GPU's own bf16 support decides
        ([], "cpu", torch.bfloat16, False),  # features unknown: no claim
    ],
)
def test_emulated_bf16_is_said_once_with_its_cost_and_the_faster_choice(monkeypatch, caplog, flags, device, dtype,
                                                                          emulated):  # fmt: skip
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu, "_warned", set())
    assert (cpu.emulated_dtype_cost(dtype, device) is not None) is emulated
    with caplog.at_level("WARNING", logger="memlm.models.cpu"):
        assert cpu.warn_if_emulated(dtype, device) is emulated
        assert cpu.warn_if_emulated(dtype, device) is False  # once per process
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == int(emulated)
    if emulated:
        assert "\n" not in lines[0] and "bfloat16 is emulated" in lines[0]
        assert (
            cpu.EMULATION_COST["bfloat16"] in lines[0]
            and "slower than float32" in lines[0]
            and "--dtype float32 or --dtype auto" in lines[0]
        )


def test_a_bf16_forward_and_load_warn_on_a_cpu_without_bf16(monkeypatch, caplog, tmp_path):
    """Both ways to a bf16 forward say it: a bf16 model built in Python (its first fp32_head) and load_causal_lm."""
    from memlm.models.forward import fp32_head
    from memlm.models.resources import load_causal_lm

    monkeypatch.setattr(cpu, "cpu_flags", lambda: ["avx2"])
    monkeypatch.setattr(cpu, "_warned", set())
    with caplog.at_level("WARNING", logger="memlm.models.cpu"):
        fp32_head(tiny_llama(torch.float32))
        assert not caplog.records
        fp32_head(tiny_llama(torch.bfloat16))
        assert len(caplog.records) == 1 and "bfloat16 is emulated" in caplog.records[0].getMessage()
    caplog.clear()
    monkeypatch.setattr(cpu, "_warned", set())
    tiny_llama().save_pretrained(tmp_path / "m")
    gpt2_tokenizer().save_pretrained(tmp_path / "m")
    with caplog.at_level("WARNING", logger="memlm.models.cpu"):
        load_causal_lm(str(tmp_path / "m"), dtype="float32")
        assert not caplog.records
        load_causal_lm(str(tmp_path / "m"), dtype="bfloat16")
        assert len(caplog.records) == 1 and "bfloat16 is emulated" in caplog.records[0].getMessage()


@pytest.mark.slow
def test_real_model_key_error_within_the_stated_error():
    """SmolLM2-135M, ffn_in@-1 on ~2k `wiki` test tokens (Wikipedia lead sections): each path's p99 relative key error
    against float32 is at most KEY_ERROR's (the numbers the datastore check uses)."""
    from memlm.data.corpora import load_documents
    from memlm.data.windows import batched, limit_documents, sliding_windows, tokenize_documents
    from memlm.models.resources import load_causal_lm

    spec = KeySpec("ffn_in", -1)

    def run(path: ComputePath) -> np.ndarray:
        model, tok = load_causal_lm("smollm2-135m", dtype=path.dtype)
        apply_compute_path(model, path, tokenizer=tok)
        docs = limit_documents(load_documents("wiki", "test"), tok, 2048)
        windows = sliding_windows(tokenize_documents(docs, tok), 512, 256)
        out = [o.keys[spec] for b in forward_windows(model, batched(windows, 2), [spec], False) for o in b]
        return np.concatenate(out)

    ref = run(ComputePath("float32"))
    paths = ("bfloat16", "none"), ("float32", "int8-dynamic"), ("float32", "int8")
    for path in (ComputePath(d, quantize=q) for d, q in paths):
        e = relative_key_error(run(path), ref)
        assert np.percentile(e, 99) <= KEY_ERROR[(path.dtype, path.quantize)], path.label()


def cli_setup(tmp_path) -> tuple[list[str], dict[str, object], list[str]]:
    """A saved tiny Llama with GPT-2's tokenizer, train/test JSONL corpora (the evaluated text outside the
    datastore): the shared CLI arguments, the corpora's paths, and ``datastore build``'s arguments."""
    import json

    model_dir = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(model_dir)
    gpt2_tokenizer().save_pretrained(model_dir)
    corpora = {}
    for name, seed in (("train", 0), ("test", 9)):
        corpora[name] = tmp_path / f"{name}.jsonl"
        docs = make_toy_docs(8, seed=seed)
        corpora[name].write_text("".join(json.dumps({"id": f"{name}-{d.id}", "text": d.text}) + "\n" for d in docs))
    common = ["--model", str(model_dir), "--window", "32", "--min-context", "8"]
    build = [*common, "--corpus", str(corpora["train"]), "--out", str(tmp_path / "ds"), "--holdout", "0"]
    return common, corpora, build


def test_cli_records_the_path_and_refuses_a_query_past_the_tolerance(tmp_path):
    """`datastore build --attention eager` records its path; `eval` on int8 keys against it is refused with one error;
    int8 on a bfloat16 model is refused before any model is loaded."""
    import json

    from test_reliability import memlm

    common, corpora, build = cli_setup(tmp_path)
    r = memlm("datastore", "build", *build, "--attention", "eager")
    assert r.returncode == 0, r.stderr
    path = json.loads((tmp_path / "ds" / "manifest.json").read_text())["build"]["compute_path"]
    assert (path["dtype"], path["attention"], path["quantize"]) == ("float32", "eager", "none")
    evaluate = [*common, "--corpus", str(corpora["test"]), "--memory", str(tmp_path / "ds")]
    r = memlm("eval", *evaluate, "--quantize", "int8-dynamic")
    assert r.returncode == 2 and "built on compute path float32+eager" in r.stderr and "int8" in r.stderr
    r = memlm("eval", *evaluate)  # the default path: allowed
    assert r.returncode == 0, r.stderr
    r = memlm("eval", *common, "--corpus", str(corpora["test"]), "--dtype", "bfloat16", "--quantize", "int8-dynamic")
    assert r.returncode == 2 and "pass --dtype float32" in r.stderr
