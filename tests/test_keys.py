"""memlm.models.keys: every key role resolves structurally on tiny random GPT-2 / Llama / GPT-NeoX / OPT models and
captures exactly the tensor the papers mean (checked against HF's ``output_hidden_states`` and against the
norm modules' own outputs, hooked independently of memlm)."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memlm.errors import MemlmError
from memlm.models.keys import (
    KEY_ROLES,
    KeyCapture,
    KeySpec,
    find_decoder_layers,
    key_dim,
    key_module_name,
    num_layers,
    resolve_key_module,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

N_LAYERS, HIDDEN, VOCAB = 3, 32, 97
BATCH, SEQ = 2, 7


def _config(arch: str):
    t = transformers
    if arch == "gpt2":
        return t.GPT2Config(n_layer=N_LAYERS, n_embd=HIDDEN, n_head=4, n_positions=64, vocab_size=VOCAB)
    if arch == "llama":
        return t.LlamaConfig(
            num_hidden_layers=N_LAYERS, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        )  # fmt: skip
    if arch in ("neox_parallel", "neox_sequential"):
        return t.GPTNeoXConfig(
            num_hidden_layers=N_LAYERS, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_attention_heads=4,
            use_parallel_residual=arch == "neox_parallel", vocab_size=VOCAB,
        )  # fmt: skip
    if arch == "opt":
        return t.OPTConfig(
            num_hidden_layers=N_LAYERS, hidden_size=HIDDEN, ffn_dim=4 * HIDDEN, num_attention_heads=4,
            word_embed_proj_dim=HIDDEN, do_layer_norm_before=True, vocab_size=VOCAB,
        )  # fmt: skip
    if arch == "mixtral":  # MoE with fused expert weights (3-D parameters): the fallback FFN rule
        return t.MixtralConfig(
            num_hidden_layers=N_LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, vocab_size=VOCAB,
        )  # fmt: skip
    raise AssertionError(arch)


@functools.cache
def _model(arch: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch)).eval()
    with torch.no_grad():  # fresh norms are the identity affine map; make every norm distinct
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


ARCHS = ["gpt2", "llama", "neox_parallel", "neox_sequential", "opt"]


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _layer(model: nn.Module, arch: str, i: int) -> nn.Module:
    """The i-th decoder block, found the plain HF way (independent of memlm's structural search)."""
    if arch == "gpt2":
        return model.transformer.h[i]
    if arch.startswith("neox"):
        return model.gpt_neox.layers[i]
    if arch == "opt":
        return model.model.decoder.layers[i]
    return model.model.layers[i]


# per arch: (norm before attention, norm before the FFN) inside a block, by their HF attribute names
NORMS = {
    "gpt2": ("ln_1", "ln_2"),
    "llama": ("input_layernorm", "post_attention_layernorm"),
    "neox_parallel": ("input_layernorm", "post_attention_layernorm"),
    "neox_sequential": ("input_layernorm", "post_attention_layernorm"),
    "opt": ("self_attn_layer_norm", "final_layer_norm"),
}

# what the structural rules must resolve to (layer 1), as "<path> (input|output)"
EXPECTED = {
    "gpt2": {
        "ffn_in": "transformer.h.1.mlp (input)", "ffn_out": "transformer.h.1.mlp (output)",
        "attn_in": "transformer.h.1.attn (input)", "attn_out": "transformer.h.1.attn (output)",
        "block_out": "transformer.h.1 (output)", "final": "lm_head (input)",
    },
    "llama": {
        "ffn_in": "model.layers.1.mlp (input)", "ffn_out": "model.layers.1.mlp (output)",
        "attn_in": "model.layers.1.self_attn (input)", "attn_out": "model.layers.1.self_attn (output)",
        "block_out": "model.layers.1 (output)", "final": "lm_head (input)",
    },
    "neox_parallel": {
        "ffn_in": "gpt_neox.layers.1.mlp (input)", "ffn_out": "gpt_neox.layers.1.mlp (output)",
        "attn_in": "gpt_neox.layers.1.attention (input)", "attn_out": "gpt_neox.layers.1.attention (output)",
        "block_out": "gpt_neox.layers.1 (output)", "final": "lm_head (input)",
    },
    "opt": {
        "ffn_in": "model.decoder.layers.1.fc1 (input)", "ffn_out": "model.decoder.layers.1.fc2 (output)",
        "attn_in": "model.decoder.layers.1.self_attn (input)",
        "attn_out": "model.decoder.layers.1.self_attn (output)",
        "block_out": "model.decoder.layers.1 (output)", "final": "lm_head (input)",
    },
}  # fmt: skip
EXPECTED["neox_sequential"] = EXPECTED["neox_parallel"]
for _arch, _ffn in (
    ("gpt2", "transformer.h.1.mlp"),
    ("llama", "model.layers.1.mlp"),
    ("neox_parallel", "gpt_neox.layers.1.mlp"),
    ("opt", "model.decoder.layers.1.fc1"),
):
    EXPECTED[_arch]["ffn_in_raw"] = f"{_ffn} (before its norm)"  # fmt: skip


def _capture_all(model: nn.Module, layer: int, ids: torch.Tensor):
    specs = [KeySpec(r, layer) for r in KEY_ROLES]
    with torch.no_grad(), KeyCapture(model, specs) as cap:
        out = model(input_ids=ids, output_hidden_states=True)
    return {s.role: cap.keys_by_spec[s] for s in specs}, out


def _hook_outputs(modules: dict[str, nn.Module]):
    """Record the outputs of the given modules with plain torch hooks (returns store, handles)."""
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in modules.items():

        def hook(_m, _a, out, name=name):
            store[name] = out[0] if isinstance(out, tuple) else out

        handles.append(mod.register_forward_hook(hook))
    return store, handles


def _no_hooks_left(model: nn.Module) -> bool:
    """No hook installed by memlm.models.keys remains (transformers installs its own output-capturing hooks)."""
    for m in model.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            for fn in hooks.values():
                if getattr(fn, "__module__", None) == "memlm.models.keys":
                    return False
    return True


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# resolution and shapes
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_roles_resolve_to_expected_modules(arch):
    model = _model(arch)
    assert num_layers(model) == N_LAYERS
    assert find_decoder_layers(model)[1] is _layer(model, arch, 1)
    for role in KEY_ROLES:
        assert key_module_name(model, KeySpec(role, 1)) == EXPECTED[arch][role], role
        module, kind = resolve_key_module(model, KeySpec(role, 1))
        name = EXPECTED[arch][role]
        assert kind == ("pre" if name.endswith("(input)") else "raw" if name.endswith("(before its norm)") else "post")
        assert isinstance(module, nn.Module)


@pytest.mark.parametrize("arch", [*ARCHS, "mixtral"])
@pytest.mark.parametrize("layer", [0, 1, -1])
def test_every_role_yields_batch_seq_dim(arch, layer):
    model = _model(arch)
    keys, _ = _capture_all(model, layer, _ids())
    for role in KEY_ROLES:
        dim = key_dim(model, KeySpec(role, layer))
        assert dim == HIDDEN
        assert tuple(keys[role].shape) == (BATCH, SEQ, dim), role
        assert torch.isfinite(keys[role]).all()


# ---------------------------------------------------------------------------------------------------------
# the captured tensors are the right ones
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_block_out_equals_hidden_states(arch):
    model = _model(arch)
    for i in range(N_LAYERS - 1):  # the last entry of hidden_states is after the final norm
        keys, out = _capture_all(model, i, _ids())
        assert _close(keys["block_out"], out.hidden_states[i + 1]), i
        assert not _close(keys["block_out"], out.hidden_states[i]), i


@pytest.mark.parametrize("arch", ARCHS)
def test_final_is_what_the_output_softmax_reads(arch):
    model = _model(arch)
    keys, out = _capture_all(model, -1, _ids())
    # transformers 5.x stores the last hidden state after the final norm for all four architectures
    assert _close(keys["final"], out.hidden_states[-1])
    assert _close(model.get_output_embeddings()(keys["final"]), out.logits)
    assert not _close(keys["final"], keys["block_out"])  # the final norm lies between them


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layer", [0, N_LAYERS - 1])
def test_ffn_in_and_attn_in_equal_the_norm_outputs(arch, layer):
    """ffn_in / attn_in are the outputs of the block's layer norms (hooked here directly, by HF name)."""
    model = _model(arch)
    block = _layer(model, arch, layer)
    attn_norm, ffn_norm = NORMS[arch]
    store, handles = _hook_outputs({"attn": getattr(block, attn_norm), "ffn": getattr(block, ffn_norm)})
    try:
        keys, _ = _capture_all(model, layer, _ids())
    finally:
        for h in handles:
            h.remove()
    ffn_norm_out = store["ffn"].view(BATCH, SEQ, HIDDEN)  # OPT flattens to [B*T, H] inside the block
    assert _close(keys["ffn_in"], ffn_norm_out)
    assert _close(keys["attn_in"], store["attn"])
    assert not _close(keys["ffn_in"], keys["attn_in"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layer", [0, N_LAYERS - 1])
def test_ffn_in_recomputed_from_block_input(arch, layer):
    """Recompute LN(x) by hand: sequential blocks norm x + attn_out, GPT-NeoX's parallel residual norms x."""
    model = _model(arch)
    block = _layer(model, arch, layer)
    attn_norm, ffn_norm = NORMS[arch]
    keys, out = _capture_all(model, layer, _ids())
    x = out.hidden_states[layer]  # the block's input (never the final-normed entry for layer < N_LAYERS)
    with torch.no_grad():
        assert _close(keys["attn_in"], getattr(block, attn_norm)(x))
        ffn_input = x if arch == "neox_parallel" else x + keys["attn_out"]
        assert _close(keys["ffn_in"], getattr(block, ffn_norm)(ffn_input))


@pytest.mark.parametrize("arch", [*ARCHS, "mixtral"])
def test_block_out_is_input_plus_attn_out_plus_ffn_out(arch):
    """attn_out and ffn_out are the two residual branches: block_out = x + attn_out + ffn_out."""
    model = _model(arch)
    for layer in range(N_LAYERS):
        keys, out = _capture_all(model, layer, _ids())
        x = out.hidden_states[layer]
        assert _close(keys["block_out"], x + keys["attn_out"] + keys["ffn_out"]), layer
        assert not _close(keys["block_out"], x + keys["attn_out"]), layer


# ---------------------------------------------------------------------------------------------------------
# several specs, gradients, early stop
# ---------------------------------------------------------------------------------------------------------


def test_several_specs_in_one_pass_equal_single_captures():
    model = _model("llama")
    ids = _ids()
    specs = [KeySpec("ffn_in", -1), KeySpec("final"), KeySpec("block_out", 0)]
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad(), KeyCapture(model, specs) as cap:
            model(input_ids=ids)
    finally:
        handle.remove()
    assert len(calls) == 1  # one forward pass
    for spec in specs:
        with torch.no_grad(), KeyCapture(model, spec) as single:
            model(input_ids=ids)
        assert torch.equal(cap.keys_by_spec[spec], single.keys)
    with pytest.raises(MemlmError, match="keys_by_spec"):
        _ = cap.keys


def test_specs_as_strings_and_duplicates():
    model = _model("gpt2")
    with torch.no_grad(), KeyCapture(model, ["ffn_in@-1", "final", KeySpec("ffn_in", -1)]) as cap:
        model(input_ids=_ids())
    assert cap.specs == (KeySpec("ffn_in", -1), KeySpec("final", -1))
    assert all(k is not None for k in cap.keys_by_spec.values())


def test_keys_are_none_before_forward_and_overwritten_by_each_pass():
    model = _model("gpt2")
    with torch.no_grad(), KeyCapture(model, KeySpec("final")) as cap:
        assert cap.keys is None
        model(input_ids=_ids(1))
        first = cap.keys
        model(input_ids=_ids(2)[:, :4])
        assert cap.keys.shape == (BATCH, 4, HIDDEN)
        assert first.shape == (BATCH, SEQ, HIDDEN)
        cap.clear()
        assert cap.keys is None


def test_empty_spec_list_captures_nothing():
    model = _model("gpt2")
    with torch.no_grad(), KeyCapture(model, []) as cap:
        model(input_ids=_ids())
    assert cap.keys_by_spec == {}
    assert _no_hooks_left(model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_detach_false_keeps_the_graph(arch):
    model = _model(arch)
    model.zero_grad(set_to_none=True)
    with KeyCapture(model, [KeySpec("ffn_in", -1), KeySpec("final")], detach=False) as cap:
        model(input_ids=_ids())
    keys = cap.keys_by_spec[KeySpec("ffn_in", -1)]
    assert keys.requires_grad
    keys.pow(2).sum().backward()
    emb = model.get_input_embeddings().weight
    assert emb.grad is not None and emb.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)

    with KeyCapture(model, KeySpec("ffn_in", -1)) as cap:  # default: detached
        model(input_ids=_ids())
    assert not cap.keys.requires_grad


def test_detached_keys_are_copies():
    model = _model("llama")
    with torch.no_grad(), KeyCapture(model, KeySpec("final")) as cap:
        out = model(input_ids=_ids(), output_hidden_states=True)
    assert cap.keys.data_ptr() != out.hidden_states[-1].data_ptr()


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_stop_after_skips_the_rest_and_gives_the_same_keys(arch):
    model = _model(arch)
    spec = KeySpec("ffn_in", 0)
    with torch.no_grad(), KeyCapture(model, spec) as full:
        model(input_ids=_ids())
    ran = []
    handles = [
        _layer(model, arch, N_LAYERS - 1).register_forward_hook(lambda *a: ran.append("last_layer")),
        model.get_output_embeddings().register_forward_hook(lambda *a: ran.append("head")),
    ]
    try:
        with torch.no_grad(), KeyCapture(model, spec, stop_after=True) as cap:
            result = cap.run(input_ids=_ids(), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert result is None
    assert ran == []
    assert torch.equal(cap.keys, full.keys)


def test_run_without_stop_after_returns_model_output():
    model = _model("gpt2")
    with torch.no_grad(), KeyCapture(model, KeySpec("final")) as cap:
        out = cap.run(input_ids=_ids())
    assert _close(model.get_output_embeddings()(cap.keys), out.logits)
    with pytest.raises(MemlmError, match="with KeyCapture"):
        cap.run(input_ids=_ids())


# ---------------------------------------------------------------------------------------------------------
# specs, errors, hook hygiene
# ---------------------------------------------------------------------------------------------------------


def test_keyspec_parse_describe_normalize():
    assert KeySpec() == KeySpec("ffn_in", -1)
    assert KeySpec.parse("ffn_in@29") == KeySpec("ffn_in", 29)
    assert KeySpec.parse("block_out@-2") == KeySpec("block_out", -2)
    assert KeySpec.parse("final") == KeySpec("final", -1)
    assert KeySpec("ffn_in", 29).describe() == "ffn_in@29"
    assert KeySpec("ffn_in", -1).describe(30) == "ffn_in@29"
    assert KeySpec("final", 3).describe(30) == "final"
    assert KeySpec.parse(KeySpec("attn_out", 4).describe()) == KeySpec("attn_out", 4)
    assert KeySpec("attn_in", -3).normalized(3) == KeySpec("attn_in", 0)
    assert KeySpec("final", 7).normalized(3) == KeySpec("final", 2)


@pytest.mark.parametrize("bad", ["ffn", "FFN_IN", "", "att"])
def test_bad_role_raises(bad):
    with pytest.raises(MemlmError, match="unknown key role"):
        KeySpec(bad)
    with pytest.raises(MemlmError, match="unknown key role"):
        KeySpec.parse(f"{bad}@1")
    with pytest.raises(MemlmError, match="unknown key role"):
        KeyCapture(_model("gpt2"), f"{bad}@1")


def test_bad_layer_syntax_raises():
    with pytest.raises(MemlmError, match="layer number"):
        KeySpec.parse("ffn_in@last")
    with pytest.raises(MemlmError, match="integer"):
        KeySpec("ffn_in", 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layer", [N_LAYERS, -N_LAYERS - 1, 100])
def test_layer_out_of_range_raises(arch, layer):
    model = _model(arch)
    for role in ("ffn_in", "ffn_out", "attn_in", "attn_out", "block_out"):
        with pytest.raises(MemlmError, match="out of range"):
            resolve_key_module(model, KeySpec(role, layer))
        with pytest.raises(MemlmError, match="out of range"):
            key_dim(model, KeySpec(role, layer))
    with pytest.raises(MemlmError, match="out of range"):
        KeyCapture(model, [KeySpec("final"), KeySpec("ffn_in", layer)])
    assert _no_hooks_left(model)
    # the layer of `final` is irrelevant
    assert resolve_key_module(model, KeySpec("final", layer))[0] is model.get_output_embeddings()


def test_not_a_transformer_raises():
    with pytest.raises(MemlmError, match="decoder layers"):
        resolve_key_module(nn.Linear(4, 4), KeySpec("ffn_in"))

    class NoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(num_hidden_layers=5, hidden_size=4)
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    with pytest.raises(MemlmError, match="nn.ModuleList of length 5"):
        KeyCapture(NoLayers(), KeySpec("block_out", 0))


def test_layer_without_ffn_or_attention_raises():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(num_hidden_layers=2, hidden_size=8)
            self.layers = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(8, 11)

        def get_output_embeddings(self):
            return self.head

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = Tiny()
    with pytest.raises(MemlmError, match="feed-forward block"):
        resolve_key_module(model, KeySpec("ffn_in", 0))
    with pytest.raises(MemlmError, match="self-attention block"):
        resolve_key_module(model, KeySpec("attn_out", 0))
    # roles that need neither still work
    with torch.no_grad(), KeyCapture(model, [KeySpec("block_out", 0), KeySpec("final")]) as cap:
        model(torch.randn(2, 3, 8))
    assert cap.keys_by_spec[KeySpec("block_out", 0)].shape == (2, 3, 8)
    assert key_dim(model, KeySpec("final")) == 8


@pytest.mark.parametrize("arch", ARCHS)
def test_hooks_removed_on_exit_and_on_exception(arch):
    model = _model(arch)
    assert _no_hooks_left(model)
    specs = [KeySpec(r, 1) for r in KEY_ROLES]
    with torch.no_grad(), KeyCapture(model, specs):
        assert not _no_hooks_left(model)
        model(input_ids=_ids())
    assert _no_hooks_left(model)

    with pytest.raises(RuntimeError, match="boom"), KeyCapture(model, specs):
        raise RuntimeError("boom")
    assert _no_hooks_left(model)

    with pytest.raises(RuntimeError, match="inside forward"), KeyCapture(model, specs):
        bad = model.get_output_embeddings().register_forward_pre_hook(_raise_inside_forward)
        try:
            model(input_ids=_ids())
        finally:
            bad.remove()
    assert _no_hooks_left(model)

    with torch.no_grad(), KeyCapture(model, KeySpec("ffn_in"), stop_after=True) as cap:
        cap.run(input_ids=_ids(), use_cache=False)
    assert _no_hooks_left(model)


def _raise_inside_forward(*_args):
    raise RuntimeError("inside forward")


def test_capture_is_not_reentrant():
    model = _model("gpt2")
    cap = KeyCapture(model, KeySpec("final"))
    with cap, pytest.raises(MemlmError, match="already active"):
        cap.__enter__()
    assert _no_hooks_left(model)
    with cap:  # reusable after exit
        pass


# ---------------------------------------------------------------------------------------------------------
# the real model
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_135m_keys():
    resources = pytest.importorskip("memlm.models.resources")
    try:
        model, _tokenizer = resources.load_causal_lm("smollm2-135m")
    except MemlmError as error:
        pytest.skip(f"SmolLM2-135M is not available: {error}")
    model = model.float().eval()
    assert num_layers(model) == 30
    ids = torch.randint(100, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    specs = [KeySpec("final"), KeySpec("block_out", 10), KeySpec("ffn_in", -1), KeySpec("attn_in", 5)]
    with torch.no_grad(), KeyCapture(model, specs) as cap:
        out = model(input_ids=ids, output_hidden_states=True)
    k = cap.keys_by_spec
    assert _close(k[KeySpec("final")], out.hidden_states[-1])
    assert _close(k[KeySpec("block_out", 10)], out.hidden_states[11])
    assert key_dim(model, KeySpec("ffn_in", -1)) == 576
    assert k[KeySpec("ffn_in", -1)].shape == (2, 16, 576)
    assert KeySpec("ffn_in", -1).describe(num_layers(model)) == "ffn_in@29"
    assert key_module_name(model, KeySpec("ffn_in", -1)) == "model.layers.29.mlp (input)"
    with torch.no_grad():
        norm_out = model.model.layers[5].input_layernorm(out.hidden_states[5])
    assert _close(k[KeySpec("attn_in", 5)], norm_out)
    assert _no_hooks_left(model)


@pytest.mark.parametrize("arch", [*ARCHS, "mixtral"])
@pytest.mark.parametrize("layer", [0, -1])
def test_ffn_in_raw_is_the_residual_stream_entering_the_ffn(arch, layer):
    """ffn_in_raw (Khandelwal Table 5's "FFN input before layer norm") equals the input of the norm in front of the FFN
    (a plain hook on the HF attribute) and, recomputed, block input + attention output (block input alone for a
    parallel-attention block)."""
    model = _model(arch)
    block = find_decoder_layers(model)[layer]
    pre_ffn_norm = getattr(block, NORMS.get(arch, ("input_layernorm", "post_attention_layernorm"))[1])
    got = {}
    handle = pre_ffn_norm.register_forward_pre_hook(lambda _m, a: got.__setitem__("x", a[0]))
    try:
        keys, out = _capture_all(model, layer, _ids())
    finally:
        handle.remove()
    raw = keys["ffn_in_raw"]
    assert _close(raw, got["x"].reshape(raw.shape))
    i = layer % N_LAYERS
    expected = out.hidden_states[i] + (0 if arch == "neox_parallel" else keys["attn_out"])
    assert _close(raw, expected)
    assert not _close(raw, keys["ffn_in"])  # before the norm is not after it
    assert _no_hooks_left(model)


@pytest.mark.parametrize("role", ["ffn_in", "final"])
def test_keys_only_forward_skips_the_output_projection(tiny_lm, role):
    """A datastore build's forward (keys, no log-probabilities) asks the model for the last position's logits only
    (``logits_to_keep=1``) and gets the same keys as the full forward; not for the ``final`` key, which is read at
    the output projection's input (with it, that key would hold the last position alone)."""
    import numpy as np

    from memlm.data.windows import TokenChunk, batched, sliding_windows
    from memlm.models.forward import forward_windows

    model, _ = tiny_lm
    spec = KeySpec.parse(role)
    chunk = TokenChunk(np.arange(3, 3 + 40, dtype=np.int64), 0, 0)
    windows = list(sliding_windows([chunk], 16, 4))
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("logits_to_keep")), with_kwargs=True)
    try:
        full = [o for out in forward_windows(model, batched(windows, 2), [spec]) for o in out]
        keys_only = [o for out in forward_windows(model, batched(windows, 2), [spec], with_logprobs=False) for o in out]
    finally:
        hook.remove()
    n = (len(windows) + 1) // 2
    assert seen[n:] == [None if role == "final" else 1] * n
    # scoring asks for the scored positions' logits only (a mask: tests/test_forward.py), never with the final key
    if role == "final":
        assert seen[:n] == [None] * n
    else:
        assert all(k.dtype == torch.bool and int(k.sum()) == sum(w.n_targets for w in b)
                   for k, b in zip(seen[:n], batched(windows, 2), strict=True))  # fmt: skip
    for a, b in zip(full, keys_only, strict=True):
        np.testing.assert_array_equal(a.keys[spec], b.keys[spec])
        assert b.lm_logprob is None


@pytest.mark.parametrize("role", ["ffn_in@0", "final"])
def test_keys_only_forward_stops_after_the_deepest_key(tiny_lm, role):
    """A keys-only forward (a datastore build) ends once its keys are captured: for ``ffn_in@0`` the second layer
    never runs, for ``final`` the output projection never runs; the keys are those of the full forward."""
    import numpy as np

    from memlm.data.windows import TokenChunk, batched, sliding_windows
    from memlm.models.forward import forward_windows
    from memlm.models.keys import find_decoder_layers

    model, _ = tiny_lm
    spec = KeySpec.parse(role)
    windows = list(sliding_windows([TokenChunk(np.arange(3, 43, dtype=np.int64), 0, 0)], 16, 4))
    skipped = model.get_output_embeddings() if role == "final" else find_decoder_layers(model)[1]
    calls = []
    hook = skipped.register_forward_hook(lambda m, a, o: calls.append(1))  # runs when the module has run
    try:
        full = [o for out in forward_windows(model, batched(windows, 2), [spec]) for o in out]
        n_full = len(calls)
        keys_only = [o for out in forward_windows(model, batched(windows, 2), [spec], with_logprobs=False) for o in out]
    finally:
        hook.remove()
    assert n_full == (len(windows) + 1) // 2 and len(calls) == n_full  # not called by the keys-only pass
    for a, b in zip(full, keys_only, strict=True):
        np.testing.assert_array_equal(a.keys[spec], b.keys[spec])
    assert _no_hooks_left(model)
