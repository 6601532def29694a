"""``--quantize int8`` (memlm.models.int8): the int8 product against a NumPy transcription of SmoothQuant's equations
(Xiao et al. 2023, Eqs. 1-4, per-token activations and per-channel weights), which layers it replaces, the inputs
quantized once per group, keys within the stated error, and the compute-path checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import gpt2_tokenizer, make_toy_docs
from test_compute_path import keys_of, tiny_llama
from torch import nn

from memlm.errors import MemlmError
from memlm.models import cpu
from memlm.models import int8 as int8_lib
from memlm.models.compute import KEY_ERROR, ComputePath, apply_compute_path, check_compute_paths, describe_compute_path
from memlm.models.compute import relative_key_error as rke
from memlm.models.int8 import (
    Int8Linear,
    ReducedRangeInt8Linear,
    SharedInput,
    int8_products_exact,
    quantize_int8,
    quantize_rows,
    smooth_factor,
)
from memlm.models.keys import KEY_ROLES, find_decoder_layers
from memlm.models.resources import model_fingerprint

#: the tests that multiply through torch._int_mm: on a CPU where its int8 products saturate, memlm refuses the path
exact_int8 = pytest.mark.skipif(not int8_products_exact(), reason="int8 products saturate on this CPU (no VNNI/AMX)")
NATIVE = int8_lib.int8_products_native


@pytest.fixture(autouse=True)
def _int8_allowed_without_vnni(monkeypatch):
    """These tests check int8's numbers, which are exact wherever int8_products_exact holds; on a CPU without int8
    dot-product instructions memlm refuses the path as slow (test_int8_is_refused_as_slow_without_vnni), so the
    speed check is passed here."""
    monkeypatch.setattr(int8_lib, "int8_products_native", lambda: True)


def numpy_w8a8(x: np.ndarray, w: np.ndarray, sigma: np.ndarray, bias: np.ndarray | None,
               outliers: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """SmoothQuant's W8A8 product written out: x' = x / σ, W' = W diag(σ); symmetric int8 with one scale per token
    (row of x') and per output channel (row of W'), integer sum, rescaled. With ``outliers`` (LLM.int8()'s
    decomposition, Dettmers et al. 2022, Sec. 3.2: C = Σ_{h∈O} X_h W_h + S · Σ_{h∉O} X_i8 W_i8), those input channels'
    product in float and the W8A8 product over the other channels only."""
    if outliers is not None:
        rest = np.setdiff1d(np.arange(x.shape[1]), outliers)
        y = numpy_w8a8(x[:, rest], w[:, rest], sigma[rest], bias)
        return y + x[:, outliers] @ w[:, outliers].T
    xs, ws = x / sigma, w * sigma
    s_x = np.maximum(np.abs(xs).max(1, keepdims=True), 1e-8) / 127
    s_w = np.maximum(np.abs(ws).max(1, keepdims=True), 1e-8) / 127
    qx = np.clip(np.round(xs / s_x), -127, 127).astype(np.int64)
    qw = np.clip(np.round(ws / s_w), -127, 127).astype(np.int64)
    y = (qx @ qw.T).astype(np.float64) * s_x * s_w.T
    return y if bias is None else y + bias


def test_quantize_rows_is_symmetric_int8_per_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [254.0, 127.0, -1.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -0]]  # 63.5 rounds to even 64; 0.5 -> 0
    assert s.flatten().tolist() == pytest.approx([2 / 127, 1e-8 / 127, 2.0])


@pytest.mark.parametrize("bias", [False, True])
@exact_int8
def test_int8_linear_matches_the_numpy_transcription(bias):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(48, 40, bias=bias)
    x = torch.randn(3, 7, 48, generator=g)
    x[..., 5] *= 30  # an outlier channel, as in LLM activations
    sigma = torch.rand(48, generator=g) + 0.5
    got = Int8Linear(lin, sigma)(x)
    assert got.shape == (3, 7, 40) and got.dtype == torch.float32
    b = None if lin.bias is None else lin.bias.detach().double().numpy()
    want = numpy_w8a8(x.reshape(-1, 48).double().numpy(), lin.weight.detach().double().numpy(),
                      sigma.double().numpy(), b)  # fmt: skip
    np.testing.assert_allclose(got.reshape(-1, 40).numpy(), want, rtol=1e-4, atol=1e-5)


@exact_int8
@pytest.mark.parametrize("bias", [False, True])
def test_outlier_channels_match_the_numpy_decomposition(bias):
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(48, 40, bias=bias)
    x = torch.randn(3, 7, 48, generator=g)
    x[..., 5] *= 30
    x[..., 17] *= -50
    sigma = torch.rand(48, generator=g) + 0.5
    outliers = torch.tensor([5, 17, 30])
    layer = Int8Linear(lin, sigma, outliers=outliers)
    got = layer(x)
    b = None if lin.bias is None else lin.bias.detach().double().numpy()
    want = numpy_w8a8(x.reshape(-1, 48).double().numpy(), lin.weight.detach().double().numpy(),
                      sigma.double().numpy(), b, outliers.numpy())  # fmt: skip
    np.testing.assert_allclose(got.reshape(-1, 40).numpy(), want, rtol=1e-4, atol=1e-5)
    # not the plain W8A8 product: the outlier channels left the int8 scales
    plain = numpy_w8a8(x.reshape(-1, 48).double().numpy(), lin.weight.detach().double().numpy(),
                       sigma.double().numpy(), b)  # fmt: skip
    assert np.abs(got.reshape(-1, 40).numpy() - plain).max() > 1e-3
    with pytest.raises(MemlmError, match="out of range"):
        Int8Linear(lin, sigma, outliers=torch.tensor([48]))


@exact_int8
def test_outlier_channels_in_float32_cut_the_error_of_a_heavy_channel():
    """One activation channel 1000x the others, no smoothing: taking it out of the int8 product (its float32 share
    added back) leaves a fraction of the plain per-token product's error."""
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(256, 64, generator=g)
    x[:, 3] *= 1000
    exact = lin(x).detach()
    err = lambda y: ((y - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(Int8Linear(lin, None, outliers=torch.tensor([3]))(x)) < 0.2 * err(Int8Linear(lin, None)(x))


@exact_int8
def test_smoothing_moves_an_outlier_channel_into_the_weights():
    """With one activation channel 100x the others, the smoothed product is closer to float32's than the plain one."""
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(256, 64, generator=g)
    x[:, 3] *= 100
    exact = lin(x).detach()
    plain = Int8Linear(lin, None)(x)
    smooth = Int8Linear(lin, smooth_factor(x.abs().amax(0), [lin.weight], 0.5))(x)
    err = lambda y: ((y - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(smooth) < 0.5 * err(plain)


def test_smooth_factor_is_eq4_with_the_groups_weight_maximum():
    a = torch.tensor([4.0, 1.0, 9.0])
    w1 = torch.tensor([[1.0, -2.0, 0.5], [0.25, 1.0, -1.0]])
    w2 = torch.tensor([[-3.0, 0.5, 0.5]])
    wmax = np.array([3.0, 2.0, 1.0])
    for alpha in (0.5, 0.8):
        want = np.array([4.0, 1.0, 9.0]) ** alpha / wmax ** (1 - alpha)
        np.testing.assert_allclose(smooth_factor(a, [w1, w2], alpha).numpy(), want, rtol=1e-6)


@exact_int8
def test_shared_input_is_quantized_once_per_forward_and_then_let_go():
    calls = []
    shared = SharedInput(None, lambda x, inv: calls.append(1) or int8_lib.quantize_input(x, inv))
    layers = [Int8Linear(nn.Linear(16, n), None, shared) for n in (16, 8, 8)]
    assert shared.users == 3
    x = torch.randn(2, 5, 16)
    outs = [m(x) for m in layers]
    assert len(calls) == 1
    assert shared._quantized is None and shared._x is None  # the last user let the batch go
    y = x.clone()  # same values, another tensor: quantized again, the same outputs
    for m, want in zip(layers, outs, strict=True):
        torch.testing.assert_close(m(y), want)
    assert len(calls) == 2
    layers[0](y)
    layers[0](y + 1)  # a new tensor before the group finished: quantized, not served the stale one
    assert len(calls) == 4


def test_fused_ops_give_the_eager_operations_bit_for_bit(monkeypatch):
    """The compiled element-wise ops (quantize an input, rescale int32 sums) against the same functions run op by op;
    on a machine where torch.compile fails they fall back to those, with a warning."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 24, generator=g) * torch.linspace(0.1, 30, 24)
    inv = 1 / (torch.rand(24, generator=g) + 0.5)
    acc = torch.randint(-(2**23), 2**23, (111, 40), dtype=torch.int32, generator=g)
    s_x, s_w = torch.rand(111, 1, generator=g), torch.rand(40, generator=g)
    for args, fused in (((x, inv), int8_lib.quantize_input), ((x, None), int8_lib.quantize_input),
                        ((acc, s_x, s_w), int8_lib.rescale)):  # fmt: skip
        got, want = fused(*args), fused.fn(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):  # fmt: skip
            assert torch.equal(a, b)
    # the outlier channels' multiply-adds: the C++ compiler may contract them into FMAs, so compiled and eager agree
    # within float32 rounding, not bit for bit; both against acc · s_x · s_w + x_out · w_out_t in float64
    x_out, w_out_t = torch.randn(111, 8, generator=g) * 40, torch.randn(8, 40, generator=g)
    want = acc.double() * s_x.double() * s_w.double() + x_out.double() @ w_out_t.double()
    for got in (int8_lib.rescale_outliers(acc, s_x, s_w, x_out, w_out_t),
                int8_lib._rescale_outliers(acc, s_x, s_w, x_out, w_out_t)):  # fmt: skip
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
    q, s = int8_lib.quantize_input(x, inv)
    assert q.dtype == torch.int8 and q.shape == (111, 24) and s.shape == (111, 1)
    np.testing.assert_allclose((q.float() * s).numpy(), (x.reshape(-1, 24) * inv).numpy(), atol=float(s.max()) / 2)

    def boom(*_a, **_k):
        raise RuntimeError("no C++ compiler")

    broken = int8_lib.FusedOps(int8_lib._rescale)
    broken.mode = "inductor"
    monkeypatch.setattr(torch, "compile", boom)
    with pytest.warns(UserWarning, match="torch.compile of _rescale failed"):
        out = broken(acc, s_x, s_w)
    assert broken.mode == "eager" and torch.equal(out, int8_lib._rescale(acc, s_x, s_w))


def calibration_texts() -> list[str]:
    return [d.text for d in make_toy_docs(12, seed=3)]


@exact_int8
def test_quantize_int8_replaces_all_but_the_down_projections_and_the_last_layer():
    model = tiny_llama()
    fingerprint = model_fingerprint(model)
    ref = keys_of(model)
    q = apply_compute_path(tiny_llama(), ComputePath("float32", quantize="int8"), gpt2_tokenizer(), calibration_texts())
    first, last = find_decoder_layers(q)
    assert {n for n, m in first.named_modules() if isinstance(m, Int8Linear)} == {
        f"self_attn.{p}_proj" for p in "qkvo"} | {"mlp.gate_proj", "mlp.up_proj"}  # fmt: skip
    assert type(first.mlp.down_proj) is nn.Linear
    assert not any(isinstance(m, Int8Linear) for m in last.modules())
    assert type(q.get_output_embeddings()) is nn.Linear
    attn = first.self_attn
    shared = [attn.q_proj.shared, attn.k_proj.shared, attn.v_proj.shared, attn.o_proj.shared]
    assert len({id(s) for s in shared}) == 4  # a σ each
    assert first.mlp.gate_proj.shared is first.mlp.up_proj.shared  # one σ, quantized once
    assert model_fingerprint(q) == fingerprint  # the weights it was loaded with
    info = describe_compute_path(q)
    assert info["quantize"] == "int8" and info["int8"]["quantized_linears"] == 6 and info["int8"]["input_groups"] == 5
    assert info["int8"]["outlier_channels"] == int8_lib.OUTLIER_CHANNELS
    for layer in (attn.q_proj, attn.k_proj, first.mlp.gate_proj, first.mlp.up_proj):
        assert layer.outliers.numel() == int8_lib.OUTLIER_CHANNELS  # multiplied in float32, left out of the int8
        assert torch.all(layer.shared.inv_smooth[layer.outliers] == 0)
        assert torch.all(layer.weight_int8_t[layer.outliers] == 0)
    assert torch.equal(first.mlp.gate_proj.outliers, first.mlp.up_proj.outliers)  # one input, one set of channels
    assert info["int8"]["elementwise_ops"] in ("inductor", "eager")
    got = keys_of(q)
    for role in KEY_ROLES:
        e = rke(got[role], ref[role])
        assert 0 < np.percentile(e, 99) <= KEY_ERROR[("float32", "int8")], role


def test_int8_path_refusals():
    with pytest.raises(MemlmError, match="--dtype float32"):
        ComputePath("bfloat16", quantize="int8")
    with pytest.raises(MemlmError, match="tokenizer"):
        apply_compute_path(tiny_llama(), ComputePath("float32", quantize="int8"))
    if int8_products_exact():
        with pytest.raises(MemlmError, match="at least 16 tokens"):
            quantize_int8(tiny_llama(), gpt2_tokenizer(), ["the cat"])
        with pytest.raises(MemlmError, match="outliers must be >= 0"):
            quantize_int8(tiny_llama(), gpt2_tokenizer(), calibration_texts(), outliers=-1)
    built = {"dtype": "float32", "quantize": "int8"}
    check_compute_paths(built, {"dtype": "float32", "quantize": "int8"}, "ds")  # the same arithmetic: allowed
    with pytest.raises(MemlmError, match="float32\\+sdpa\\+int8|int8"):
        check_compute_paths(built, {"dtype": "float32", "quantize": "none"}, "ds")  # 0.08 > 0.05: refused


@exact_int8
def test_an_unchanged_float32_model_keeps_its_numbers_after_calibration():
    """Calibration runs the float32 model with hooks and removes them: the layers kept float32 are untouched."""
    q = apply_compute_path(tiny_llama(), ComputePath("float32", quantize="int8"), gpt2_tokenizer(), calibration_texts())
    ref = tiny_llama()
    _, last = find_decoder_layers(q)
    _, last_ref = find_decoder_layers(ref)
    assert not last._forward_hooks and not any(m._forward_hooks for m in q.modules())
    for (n, p), (_, p_ref) in zip(last.named_parameters(), last_ref.named_parameters(), strict=True):
        assert torch.equal(p, p_ref), n


@exact_int8
def test_cli_builds_on_int8_and_refuses_a_float32_query(tmp_path):
    """`datastore build --quantize int8` records the path and its calibration; `eval` on float32 keys against it is
    refused with one error naming both paths (0.08 + 0 > 0.05)."""
    import json

    from test_compute_path import cli_setup
    from test_reliability import memlm

    common, corpora, build = cli_setup(tmp_path)
    r = memlm("datastore", "build", *build, "--quantize", "int8")
    assert r.returncode == 0, r.stderr
    path = json.loads((tmp_path / "ds" / "manifest.json").read_text())["build"]["compute_path"]
    assert path["quantize"] == "int8" and path["int8"]["calibration"] == "wiki train"
    r = memlm("eval", *common, "--corpus", str(corpora["test"]), "--memory", str(tmp_path / "ds"))
    assert r.returncode == 2 and "built on compute path float32+sdpa+int8" in r.stderr


@pytest.mark.parametrize(
    "flags, native",
    [(["avx2"], False), (["avx2", "avx_vnni"], True), (["avx2", "avx512f", "avx512_vnni"], True),
     (["avx2", "amx_int8", "amx_tile"], True), (["bf16", "i8mm"], True), ([], True)],
)  # fmt: skip
def test_int8_products_are_native_with_vnni_amx_or_i8mm(monkeypatch, flags, native):
    """Unreadable CPU features make no claim (native)."""
    monkeypatch.setattr(int8_lib, "int8_products_native", NATIVE)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    assert int8_lib.int8_products_native() is native


fbgemm = pytest.mark.skipif(not int8_lib.fbgemm_available(), reason="no FBGEMM (not x86)")


def reduced_range_bound(x: np.ndarray, w: np.ndarray, sigma: np.ndarray, outliers: np.ndarray) -> np.ndarray:
    """The largest |y - x Wᵀ| ReducedRangeInt8Linear's rounding allows, element by element: over the channels j ∉ O,
    activations x'[t] = x[t] / σ rounded to a step of at most 2 m[t] / 127 (m[t] = max_j |x'[t, j]|: rows scaled to
    [-1, 1], 7-bit codes 0..127), weights W' = W σ to s_w[o] = max_j |W'[o, j]| / 127, each to the nearest step:
    |Δy[t, o]| <= Σ_j (m[t] / 127 · |W'[o, j]| + |x'[t, j]| · s_w[o] / 2 + m[t] / 127 · s_w[o] / 2)."""
    rest = np.setdiff1d(np.arange(x.shape[1]), outliers)
    xs, ws = x[:, rest] / sigma[rest], w[:, rest] * sigma[rest]
    dx = np.abs(xs).max(1, keepdims=True) / 127  # half of the activation step 2 m / 127
    dw = np.abs(ws).max(1, keepdims=True) / 127 / 2
    return dx * np.abs(ws).sum(1)[None, :] + np.abs(xs) @ np.broadcast_to(dw, ws.shape).T + dx * dw.T * len(rest)


@fbgemm
@pytest.mark.parametrize("outliers", [[], [5, 17]])
def test_reduced_range_linear_is_within_the_rounding_bound(outliers):
    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(96, 40, bias=True)
    x = torch.randn(3, 50, 96, generator=g)
    x[..., 5] *= 30
    x[..., 17] *= -50
    sigma = torch.rand(96, generator=g) + 0.5
    out = torch.tensor(outliers, dtype=torch.long)
    layer = ReducedRangeInt8Linear(lin, sigma, outliers=out)
    with torch.inference_mode():
        got = layer(x).reshape(-1, 40).double().numpy()
    x2, w = x.reshape(-1, 96).double().numpy(), lin.weight.detach().double().numpy()
    want = x2 @ w.T + lin.bias.detach().double().numpy()
    bound = reduced_range_bound(x2, w, sigma.double().numpy(), out.numpy())
    err = np.abs(got - want)
    assert np.all(err <= bound * 1.001 + 1e-5)
    assert err.max() > 1e-4 and np.median(err / bound) < 0.2  # rounded, not exact; the bound is not vacuous
    assert layer.weight_outlier_t.shape == (len(outliers), 40) if outliers else layer.outliers is None


@fbgemm
def test_reduced_range_products_are_exact_where_8_bit_pairs_saturate():
    """All-positive rows times all-positive weights: every 7-bit code is 127 and every pair sums to 127 · 127 · 2 =
    32,258 < 32,767, so the int32 sums are exact and y = x Wᵀ exactly. With 8-bit codes (255) the pair is 64,770: a
    u8 × s8 product summed in saturating int16 pairs (vpmaddubsw, x86 without VNNI) gives 32,767 per pair, about half,
    as FBGEMM's full-range product does on such a CPU."""
    lin = nn.Linear(64, 8, bias=False)
    lin.weight.data.fill_(0.5)
    x = torch.full((4, 64), 2.0)
    layer = ReducedRangeInt8Linear(lin)
    with torch.inference_mode():
        assert torch.allclose(layer(x), torch.full((4, 8), 64.0), rtol=1e-6)
        full = torch.ops.quantized.linear_dynamic(x / 2.0, layer._packed, False)  # 8-bit codes, the same weights
    codes, wq = np.full((4, 32, 2), 255), np.full((2,), 127)
    pairs = np.minimum((codes * wq).sum(-1), 32767).sum(-1)
    assert pairs[0] == 32 * 32767 < 64 * 255 * 127  # where a saturating product would lose half the sum
    if not any(f in cpu.cpu_flags() for f in int8_lib.INT8_FEATURES) and cpu.cpu_flags():
        assert full.max() < 0.6 * 32.0  # this CPU's 8-bit product saturates (y should be 32)


@fbgemm
def test_quantize_int8_with_the_reduced_range_layer():
    q = tiny_llama()
    info = quantize_int8(q, gpt2_tokenizer(), calibration_texts(), layer=ReducedRangeInt8Linear)
    first, last = find_decoder_layers(q)
    assert {n for n, m in first.named_modules() if isinstance(m, ReducedRangeInt8Linear)} == {
        f"self_attn.{p}_proj" for p in "qkvo"} | {"mlp.gate_proj", "mlp.up_proj"}  # fmt: skip
    assert first.mlp.gate_proj.shared is first.mlp.up_proj.shared
    assert first.mlp.up_proj.shared.prepare is int8_lib.normalize_input
    assert info["products"].startswith("FBGEMM") and info["quantized_linears"] == 6
    ids = torch.randint(0, 50257, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref, got = tiny_llama()(input_ids=ids).logits, q(input_ids=ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 0.05


#: measurements of the 7-bit path on a CPU without VNNI, and whether the rule adopts it (±0.2% interval and faster)
RULE_CASES = [
    ({"ppl_change": 0.001, "ppl_change_low": 0.0005, "ppl_change_high": 0.0015, "speed_vs_float32": 1.2}, True),
    ({"ppl_change": 0.001, "ppl_change_low": -0.002, "ppl_change_high": 0.002, "speed_vs_float32": 1.01}, True),
    ({"ppl_change": 0.0018, "ppl_change_low": 0.0015, "ppl_change_high": 0.0021, "speed_vs_float32": 1.5}, False),
    ({"ppl_change": -0.001, "ppl_change_low": -0.0021, "ppl_change_high": 0.0, "speed_vs_float32": 1.5}, False),
    ({"ppl_change": 0.001, "ppl_change_low": 0.0005, "ppl_change_high": 0.0015, "speed_vs_float32": 0.97}, False),
    ({"ppl_change": 0.001, "ppl_change_low": 0.0005, "ppl_change_high": 0.0015, "speed_vs_float32": 1.0}, False),
    ({"ppl_change": None, "ppl_change_low": None, "ppl_change_high": None, "speed_vs_float32": None}, False),
]
RULE_CASES = [({**m, "complete": True}, a) for m, a in RULE_CASES] + [  # part of the test set only: never adopted
    ({"ppl_change": 0.001, "ppl_change_low": 0.0005, "ppl_change_high": 0.0015, "speed_vs_float32": 1.2,
      "complete": False, "tokens": 90000}, False),
]  # fmt: skip


@pytest.mark.parametrize("measured, adopted", RULE_CASES)
def test_the_no_vnni_choice_follows_the_rule(monkeypatch, measured, adopted):
    """Without int8 dot-product instructions (inexact or slow ``_int_mm``), ``--quantize int8`` takes the 7-bit FBGEMM
    layer only if its perplexity interval lies within ±0.2% and it is faster than float32; else it is refused, the
    refusal naming the measurement and float32 as the faster choice. With VNNI it is always Int8Linear."""
    assert int8_lib.reduced_range_adopted(measured) is adopted
    monkeypatch.setattr(int8_lib, "REDUCED_RANGE_AVX2", {**measured, "file": "results.json"})
    monkeypatch.setattr(int8_lib, "fbgemm_available", lambda: True)
    monkeypatch.setattr(int8_lib, "int8_products_exact", lambda: True)
    assert int8_lib.int8_linear_class() is Int8Linear
    for exact, native in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(int8_lib, "int8_products_exact", lambda e=exact: e)
        monkeypatch.setattr(int8_lib, "int8_products_native", lambda n=native: n)
        if adopted:
            assert int8_lib.int8_linear_class() is ReducedRangeInt8Linear
            continue
        why = "24x slower" if exact else "not exact"
        said = "not measured" if measured["ppl_change"] is None else f"perplexity {measured['ppl_change']:+.2%}"
        said = re.escape(said)
        with pytest.raises(MemlmError, match=f"no int8 dot-product.*{why}.*{said}.*--quantize none with --dtype float"):
            int8_lib.int8_linear_class()
    monkeypatch.setattr(int8_lib, "fbgemm_available", lambda: False)  # no FBGEMM (Arm): refused
    with pytest.raises(MemlmError, match="the faster choice"):
        int8_lib.int8_linear_class()


def test_the_recorded_measurement_is_the_results_file():
    """REDUCED_RANGE_AVX2 (what the rule reads) holds the numbers of the file it names."""
    import json
    from pathlib import Path

    rec = int8_lib.REDUCED_RANGE_AVX2
    data = json.loads((Path(__file__).resolve().parents[1] / rec["file"]).read_text())
    assert {k: rec[k] for k in data["rule"]["measured"]} == data["rule"]["measured"]
    assert data["rule"]["adopted"] is int8_lib.reduced_range_adopted(rec)


def test_the_exactness_check_sees_saturated_products(monkeypatch):
    """A product computed as x86 kernels without VNNI do (the signed input shifted to unsigned, u8 x s8 pairs summed
    into 16 bits with saturation by vpmaddubsw, the shift's 128 * column sum taken off after) is caught."""
    real = torch._int_mm

    def saturating(a, b):
        u = (a.long() + 128).reshape(a.shape[0], 1, -1, 2)
        s = b.t().long().reshape(1, b.shape[1], -1, 2)
        pairs = (u * s).sum(-1).clamp(-32768, 32767)
        return (pairs.sum(-1) - 128 * b.long().sum(0)[None, :]).int()

    int8_lib.int8_products_exact.cache_clear()
    try:
        monkeypatch.setattr(torch, "_int_mm", saturating)
        assert not int8_lib.int8_products_exact()
        int8_lib.int8_products_exact.cache_clear()
        monkeypatch.setattr(torch, "_int_mm", real)
        assert int8_lib.int8_products_exact() == torch.equal(
            real(torch.full((2, 8), 127, dtype=torch.int8), torch.full((8, 2), 127, dtype=torch.int8)).long(),
            torch.full((2, 2), 8 * 127 * 127),
        )
    finally:
        int8_lib.int8_products_exact.cache_clear()


CACHE_CHECK = """
import torch
from memlm.models import int8 as m
g = torch.Generator().manual_seed(0)
x, inv = torch.randn(300, 576, generator=g) * 5, torch.rand(576, generator=g) + 0.5
q, s = m.quantize_input(x, inv)
acc = torch.randint(-2**20, 2**20, (300, 192), dtype=torch.int32, generator=g)
w = torch.rand(192, generator=g)
assert m.quantize_input.mode == "inductor"
print(torch.equal(q, m._quantize_input(x, inv)[0]) and torch.equal(m.rescale(acc, s, w), m._rescale(acc, s, w)))
"""


@pytest.mark.skipif(str(torch.backends.cpu.get_cpu_capability()) != "AVX512", reason="needs two vector ISAs")
def test_compiled_ops_are_not_served_across_vector_isas(tmp_path):
    """torch's FX graph cache keys leave out ATEN_CPU_CAPABILITY: with it, a graph compiled under AVX2 was served to
    an AVX-512 process (wrong int8 values, a heap corruption). FusedOps compiles without it: both processes, one
    inductor cache directory, get the eager numbers."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "MEMLM_INT8_COMPILE": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    for capability in ("avx2", None):
        run_env = {**env, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
        r = subprocess.run([sys.executable, "-c", CACHE_CHECK], env=run_env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip().endswith("True"), (capability, r.stdout, r.stderr[-2000:])
