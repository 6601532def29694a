"""Capture kNN-LM keys (context representations) from any Hugging Face causal LM, by role and layer.

A kNN-LM (Khandelwal et al., 2020) keys its datastore with a vector ``f(c_t)`` taken from *inside* the
model at the position that predicts the next token. Which vector matters: Khandelwal et al. (Table 5) find
the input to the last layer's feed-forward block, after its layer norm, works best; Xu et al. (2023, "Why
do nearest-neighbor language models work?") compare that vector (their "att") with the vector the output
softmax reads (their "ffn"). TRIME (Zhong et al. 2022, Sec. 3) also keys its memories with the former:
g(c) = the input of the final feed-forward block.

This module names those vectors by *role* and finds them from the model's module structure, not from a
table of per-architecture attribute names:

==============  ==============================================================================================
role            what is captured
==============  ==============================================================================================
``ffn_in``      input of a layer's feed-forward block, after its layer norm. Khandelwal et al.'s best key
                (Table 5, "FFN input after layer norm"); Xu et al.'s "att"; TRIME's g(c). Default.
``final``       the hidden state the output softmax reads (input of ``model.get_output_embeddings()``),
                i.e. after the final norm. Xu et al.'s "ffn"; TRIME's f(c). The layer
                index is ignored.
``ffn_out``     output of a layer's feed-forward block, before the residual add (a further tap for
                ablations).
``attn_out``    output of a layer's self-attention block, before the residual add (a further tap for
                ablations).
``attn_in``     input of a layer's self-attention, after its layer norm (Khandelwal et al.'s "MHSA input
                after layer norm", Table 5).
``block_out``   output of a whole decoder layer: the residual stream after it (what HF returns as
                ``hidden_states[layer + 1]``).
``ffn_in_raw``  input of a layer's feed-forward block *before* its layer norm: the residual stream entering the
                FFN sublayer (Khandelwal et al. Table 5, "FFN input before layer norm").
==============  ==============================================================================================

Layers index the decoder blocks Python-style (``-1`` is the last).

Structural rules (see :func:`resolve_key_module`):

* decoder layers: the ``nn.ModuleList`` whose length is the text config's ``num_hidden_layers`` (the one
  holding the most parameters if several qualify);
* linear-like modules: ``nn.Linear``, transformers' ``Conv1D`` (weight ``[in, out]``) and anything exposing
  integer ``in_features``/``out_features`` (quantized and LoRA wrappers); only the outermost one counts;
* feed-forward block: the layer's modules are grouped by direct child of the layer (linear-likes hanging
  directly off the layer form one extra group). A group holds an FFN when it has an *up* projection
  (``hidden -> N`` with ``N > hidden``) and a matching *down* projection (``N -> hidden``, or
  ``N/2 -> hidden`` for fused gate/up). Among such groups the one with the most parameters is the FFN.
  If no group qualifies, the direct child holding fused expert weights (parameters with 3 or more dims:
  MoE) is the FFN;
* attention block: among the other direct children, the one containing linear-likes that read the hidden
  size (the q/k/v projections), the one with the most parameters if several.

What gets hooked:

* ``ffn_in``: the FFN child's input (forward pre-hook); when the FFN hangs directly off the layer (OPT's
  ``fc1``/``fc2``), the up projection's input;
* ``ffn_out``: the FFN child's output; when it hangs directly off the layer, the down projection's output;
* ``attn_in`` / ``attn_out``: the attention child's input / output (first element of a tuple);
* ``block_out``: the decoder layer's output (first element of a tuple);
* ``final``: the input of ``model.get_output_embeddings()``;
* ``ffn_in_raw``: the input of whichever direct child of the layer (other than the attention and the FFN, and
  holding no linear-likes: the norms) produced the very tensor the FFN receives, matched by identity during the
  forward pass (so no module names and no definition order: Llama defines its post-attention norm after its MLP).
  A parallel-attention block (GPT-J) feeds the FFN the first norm's output, so the key is the block's input there.

Tensors a model flattens to ``[batch * seq, dim]`` inside a layer (OPT does) are viewed back to
``[batch, seq, dim]``.

Known limits: BLOOM adds the residual inside its attention and MLP modules, so there ``attn_out`` and
``ffn_out`` include the residual; Gemma-2/3 and OLMo-2 apply a norm to the attention / FFN output outside
the block, so ``attn_out``/``ffn_out`` are taken before that norm. ``final`` during ``generate()`` only
covers the positions the model computes logits for (``logits_to_keep``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memlm.errors import MemlmError

__all__ = [
    "KEY_ROLES",
    "KeySpec",
    "KeyCapture",
    "LayerParts",
    "LinearLike",
    "decoder_layer_parts",
    "find_decoder_layers",
    "key_dim",
    "key_module_name",
    "linear_dims",
    "num_layers",
    "outer_linears",
    "resolve_key_module",
]

KEY_ROLES: tuple[str, ...] = ("ffn_in", "final", "ffn_out", "attn_out", "attn_in", "block_out", "ffn_in_raw")
"""The key roles, default (Khandelwal et al.'s best, ``ffn_in``) first."""


@dataclass(frozen=True)
class KeySpec:
    """Which representation to use as the kNN key: a role from :data:`KEY_ROLES` and a decoder layer.

    ``layer`` indexes the decoder blocks Python-style (``-1`` = last); it is ignored for ``final``.
    """

    role: str = "ffn_in"
    layer: int = -1

    def __post_init__(self) -> None:
        if self.role not in KEY_ROLES:
            raise MemlmError(
                f"unknown key role {self.role!r}; use one of {', '.join(KEY_ROLES)} "
                "(ffn_in is Khandelwal et al.'s best key, final is what the output softmax reads)"
            )
        if isinstance(self.layer, bool) or not isinstance(self.layer, int):
            raise MemlmError(f"key layer must be an integer (got {self.layer!r}); use e.g. -1 for the last layer")

    @classmethod
    def parse(cls, text: str) -> KeySpec:
        """Parse ``"ffn_in"``, ``"ffn_in@-1"``, ``"block_out@10"`` or ``"final"`` (inverse of describe)."""
        role, sep, layer = text.strip().partition("@")
        if not sep:
            return cls(role)
        try:
            return cls(role, int(layer))
        except ValueError:
            raise MemlmError(
                f"bad key spec {text!r}: the part after '@' must be a layer number; write e.g. 'ffn_in@-1'"
            ) from None

    def normalized(self, n_layers: int) -> KeySpec:
        """This spec with a non-negative layer (``final`` maps to the last); MemlmError if out of range."""
        if self.role == "final":
            return KeySpec("final", n_layers - 1)
        if not -n_layers <= self.layer < n_layers:
            raise MemlmError(
                f"key layer {self.layer} is out of range for a model with {n_layers} decoder layers; "
                f"use a layer in [{-n_layers}, {n_layers - 1}] (-1 is the last)"
            )
        return KeySpec(self.role, self.layer % n_layers)

    def describe(self, n_layers: int | None = None) -> str:
        """``"ffn_in@29"`` style label; pass ``n_layers`` to print negative layers as absolute indices."""
        if self.role == "final":
            return "final"
        spec = self.normalized(n_layers) if n_layers is not None else self
        return f"{spec.role}@{spec.layer}"


# ----------------------------------------------------------------------------------------------------------
# structure discovery
# ----------------------------------------------------------------------------------------------------------


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text()
        except Exception:  # noqa: BLE001 - odd configs: fall back to the config itself
            return config
    return config


def _config_int(config: Any, names: Sequence[str]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the ``nn.ModuleList`` whose length is the config's ``num_hidden_layers``.

    If several lists qualify (a vision tower of the same depth, say) the one holding the most parameters wins.
    """
    n = _config_int(_text_config(model), ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    if n is None:
        raise MemlmError(
            f"cannot find the decoder layers of {type(model).__name__}: its config has no num_hidden_layers; "
            "pass a Hugging Face causal LM (AutoModelForCausalLM) whose config states its depth"
        )
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not candidates:
        raise MemlmError(
            f"cannot find the decoder layers of {type(model).__name__}: no nn.ModuleList of length {n} "
            "(config.num_hidden_layers); memlm needs a standard transformer stack of decoder blocks"
        )
    return max(candidates, key=_n_params)


def num_layers(model: nn.Module) -> int:
    """Number of decoder blocks."""
    return len(find_decoder_layers(model))


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` widths of a linear-like module (``nn.Linear``, transformers' ``Conv1D``, anything with integer
    ``in_features`` / ``out_features`` but an embedding), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2:
            return int(weight.shape[0]), int(weight.shape[1])  # weight is [in, out]
    fin, fout = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(fin, int) and isinstance(fout, int) and not isinstance(module, nn.Embedding):
        return fin, fout
    return None


@dataclass
class LinearLike:
    """A linear-like module found under a layer (:func:`outer_linears`) and its widths."""

    name: str  # qualified name inside the layer
    module: nn.Module
    fan_in: int
    fan_out: int


def outer_linears(root: nn.Module) -> list[LinearLike]:
    """Outermost linear-like modules under ``root`` (excluding root; :func:`linear_dims`), in registration order."""
    found: list[LinearLike] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}.{name}" if prefix else name
            dims = linear_dims(child)
            if dims is not None:
                found.append(LinearLike(qual, child, dims[0], dims[1]))
            else:
                walk(child, qual)

    walk(root, "")
    return found


def _up_down_pairs(linears: Sequence[LinearLike], hidden: int) -> tuple[list[LinearLike], list[LinearLike]]:
    """Up projections (hidden -> N > hidden) with a matching down projection (N or N/2 -> hidden)."""
    downs_by_in: dict[int, list[LinearLike]] = {}
    for lin in linears:
        if lin.fan_out == hidden:
            downs_by_in.setdefault(lin.fan_in, []).append(lin)
    ups: list[LinearLike] = []
    downs: list[LinearLike] = []
    for lin in linears:
        if lin.fan_in != hidden or lin.fan_out <= hidden:
            continue
        match = downs_by_in.get(lin.fan_out) or (downs_by_in.get(lin.fan_out // 2) if lin.fan_out % 2 == 0 else None)
        if match:
            ups.append(lin)
            downs.extend(d for d in match if all(d is not x for x in downs))
    return ups, downs


@dataclass
class LayerParts:
    """A decoder layer's attention block and feed-forward block (FFN), found by structure (module docstring), or why
    one was not found (``attn_problem``, ``ffn_problem``); ``hidden`` is the model's hidden size."""

    layer: nn.Module
    hidden: int
    ffn: nn.Module | None = None  # a direct child of the layer holding the whole FFN
    ffn_name: str | None = None
    ffn_up: LinearLike | None = None  # set when the FFN hangs directly off the layer (OPT)
    ffn_down: LinearLike | None = None
    ffn_problem: str | None = None
    attn: nn.Module | None = None
    attn_name: str | None = None
    attn_problem: str | None = None

    @property
    def norms(self) -> list[nn.Module]:
        """The layer's children other than the attention and feed-forward blocks that hold no linear-like module
        (its norms)."""
        skip = {id(m) for m in (self.attn, self.ffn) if m is not None}
        children = (c for _, c in self.layer.named_children() if id(c) not in skip)
        return [c for c in children if linear_dims(c) is None and not outer_linears(c)]


def _hidden_size(model: nn.Module, layer: nn.Module) -> int:
    hidden = _config_int(_text_config(model), ("hidden_size", "n_embd", "d_model", "dim"))
    if hidden is not None:
        return hidden
    # structural fallback: the most common input width of the layer's linear-likes
    widths = [lin.fan_in for lin in outer_linears(layer)]
    if not widths:
        raise MemlmError(
            f"cannot tell the hidden size of {type(model).__name__}: no hidden_size in its config and no "
            "linear layers in its decoder blocks; pass a Hugging Face transformer causal LM"
        )
    return max(set(widths), key=widths.count)


def _analyze_layer(layer: nn.Module, hidden: int) -> LayerParts:
    parts = LayerParts(layer=layer, hidden=hidden)
    children = list(layer.named_children())
    direct = [lin for lin in outer_linears(layer) if "." not in lin.name]

    # group: (name or None for "hangs directly off the layer", module or None, linears, n_params)
    groups: list[tuple[str | None, nn.Module | None, list[LinearLike], int]] = []
    if direct:
        groups.append((None, None, direct, sum(_n_params(d.module) for d in direct)))
    for name, child in children:
        if linear_dims(child) is None:
            groups.append((name, child, outer_linears(child), _n_params(child)))

    ffn_groups = [g for g in groups if _up_down_pairs(g[2], hidden)[0]]
    ffn_child_name: str | None = None
    if ffn_groups:
        name, child, lins, _ = max(ffn_groups, key=lambda g: g[3])
        if child is not None:
            parts.ffn, parts.ffn_name, ffn_child_name = child, name, name
        else:
            ups, downs = _up_down_pairs(lins, hidden)
            if len(downs) != 1:
                parts.ffn_problem = (
                    f"its feed-forward projections hang directly off the layer with {len(downs)} candidate "
                    "down projections"
                )
            else:
                parts.ffn_up, parts.ffn_down = ups[0], downs[0]
    else:
        moe = [(n, c) for n, c in children if any(p.ndim >= 3 for p in c.parameters())]
        if moe:
            ffn_child_name, parts.ffn = max(moe, key=lambda nc: _n_params(nc[1]))
            parts.ffn_name = ffn_child_name
        else:
            parts.ffn_problem = "no linear up projection (hidden -> wider) with a matching down projection"

    attn_groups = [
        g for g in groups if g[1] is not None and g[0] != ffn_child_name and any(lin.fan_in == hidden for lin in g[2])
    ]
    if attn_groups:
        parts.attn_name, parts.attn, _, _ = max(attn_groups, key=lambda g: g[3])
    else:
        parts.attn_problem = "no submodule (other than the feed-forward block) with projections of the hidden state"
    return parts


def decoder_layer_parts(model: nn.Module) -> list[LayerParts]:
    """:class:`LayerParts` of every decoder layer of ``model``, in order."""
    layers = find_decoder_layers(model)
    hidden = _hidden_size(model, layers[0])
    return [_analyze_layer(layer, hidden) for layer in layers]


def _layer_parts(model: nn.Module, layer_index: int) -> tuple[LayerParts, str]:
    layers = find_decoder_layers(model)
    layer = layers[layer_index]
    parts = _analyze_layer(layer, _hidden_size(model, layer))
    return parts, _module_name(model, layer)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    return type(module).__name__


def _output_embeddings(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        raise MemlmError(
            f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None), so the "
            "'final' key is undefined; load the model with AutoModelForCausalLM, or pick another key role"
        )
    return head


def _resolve(model: nn.Module, spec: KeySpec) -> tuple[nn.Module, str, str]:
    """(module, "pre"|"post", qualified name) for a spec."""
    if not isinstance(spec, KeySpec):
        raise MemlmError(f"expected a KeySpec, got {type(spec).__name__}; write e.g. KeySpec('ffn_in', -1)")
    if spec.role == "final":
        head = _output_embeddings(model)
        return head, "pre", _module_name(model, head)
    norm = spec.normalized(num_layers(model))
    parts, layer_name = _layer_parts(model, norm.layer)
    arch = type(model).__name__
    if spec.role == "block_out":
        return parts.layer, "post", layer_name
    if spec.role.startswith("ffn"):
        if parts.ffn is None and (parts.ffn_up is None or parts.ffn_down is None):
            raise MemlmError(
                f"cannot find the feed-forward block of {arch} layer {norm.layer} ({parts.ffn_problem}); "
                "use key role 'final' or 'block_out', which need no FFN"
            )
        kind = {"ffn_in": "pre", "ffn_out": "post", "ffn_in_raw": "raw"}[spec.role]
        if parts.ffn is not None:
            name = f"{layer_name}.{parts.ffn_name}"
            return parts.ffn, kind, f"{name} (before its norm)" if kind == "raw" else name
        lin = parts.ffn_down if kind == "post" else parts.ffn_up
        return lin.module, kind, f"{layer_name}.{lin.name}" + (" (before its norm)" if kind == "raw" else "")
    # attn_in / attn_out
    if parts.attn is None:
        raise MemlmError(
            f"cannot find the self-attention block of {arch} layer {norm.layer} ({parts.attn_problem}); "
            "use key role 'ffn_in', 'final' or 'block_out' instead"
        )
    return parts.attn, "pre" if spec.role == "attn_in" else "post", f"{layer_name}.{parts.attn_name}"


def resolve_key_module(model: nn.Module, spec: KeySpec) -> tuple[nn.Module, str]:
    """The module to hook for ``spec`` and whether its input (``"pre"``) or output (``"post"``) is the key.

    Raises MemlmError for an unknown role, a layer out of range, or a structure the rules cannot resolve.
    """
    module, kind, _ = _resolve(model, spec)
    return module, kind


def key_module_name(model: nn.Module, spec: KeySpec) -> str:
    """Human-readable location of the key, e.g. ``"model.layers.29.mlp (input)"``."""
    _, kind, name = _resolve(model, spec)
    return name if kind == "raw" else f"{name} ({'input' if kind == 'pre' else 'output'})"


def key_dim(model: nn.Module, spec: KeySpec) -> int:
    """Width of the key vectors ``spec`` captures."""
    module, kind, _ = _resolve(model, spec)
    if spec.role == "final":
        dims = linear_dims(module)
        if dims is not None:
            return dims[0]
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2:
            return int(weight.shape[1])
    dims = linear_dims(module)
    if dims is not None and kind != "raw":  # OPT-style FFN: up input / down output
        return dims[0] if kind == "pre" else dims[1]
    return _hidden_size(model, find_decoder_layers(model)[0])


# ----------------------------------------------------------------------------------------------------------
# capture
# ----------------------------------------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised from a hook to end a forward pass once every requested key has been captured."""


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    first = getattr(value, "last_hidden_state", None)  # ModelOutput-like
    if isinstance(first, torch.Tensor):
        return first
    return None


def _input_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


class KeyCapture:
    """Context manager that records kNN keys during the model's forward passes.

    ``keys`` holds the key of the last forward pass as ``[batch, seq, dim]`` (single spec); with several specs
    use ``keys_by_spec[spec]`` (None until a forward pass has produced it; no specs capture nothing). Keys
    are detached copies unless ``detach=False`` (TRIME needs gradients through them). Hooks are removed on
    exit, also when the body raises.

    With ``stop_after=True`` call :meth:`run` instead of the model: the forward pass is cut short as soon as
    every key is captured (e.g. it skips the layers above ``ffn_in@k``, or the vocabulary projection for
    ``final``) and ``run`` returns None. Pass ``use_cache=False`` then, since a cut-short pass leaves any
    KV cache half-updated.

    >>> with KeyCapture(model, KeySpec("ffn_in", -1)) as cap:
    ...     out = model(input_ids=ids)
    ...     h = cap.keys  # [B, T, D]
    """

    def __init__(
        self,
        model: nn.Module,
        spec: KeySpec | str | Iterable[KeySpec | str] | None = None,
        *,
        detach: bool = True,
        stop_after: bool = False,
    ) -> None:
        self.model = model
        if spec is None:
            spec = KeySpec()
        raw: list[KeySpec | str] = [spec] if isinstance(spec, (KeySpec, str)) else list(spec)
        parsed = (s if isinstance(s, KeySpec) else KeySpec.parse(s) for s in raw)
        self.specs: tuple[KeySpec, ...] = tuple(dict.fromkeys(parsed))  # dedupe, keep order
        self.detach = detach
        self.stop_after = stop_after
        self.keys_by_spec: dict[KeySpec, torch.Tensor | None] = dict.fromkeys(self.specs)
        self._targets = [_resolve(model, s)[:2] for s in self.specs]  # validates before any hook exists
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._lead_shape: tuple[int, int] | None = None
        self._running = False

    # -- results -------------------------------------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """Key of the last forward pass, ``[batch, seq, dim]``; None before any pass. Single spec only."""
        if len(self.specs) != 1:
            raise MemlmError(
                f"this KeyCapture records {len(self.specs)} key specs; read cap.keys_by_spec[spec] instead of cap.keys"
            )
        return self.keys_by_spec[self.specs[0]]

    def clear(self) -> None:
        """Forget the captured keys (every entry of ``keys_by_spec`` back to None)."""
        self.keys_by_spec = dict.fromkeys(self.specs)

    # -- hooks ---------------------------------------------------------------------------------------------
    def store(self, spec: KeySpec, tensor: torch.Tensor | None) -> None:
        """Record ``tensor`` (None: nothing) as the key of ``spec``, what every hook calls: a ``[batch * seq, dim]``
        tensor is viewed back to ``[batch, seq, dim]``; with ``stop_after`` the pass stops once every key is in."""
        if tensor is None:
            return
        if tensor.ndim == 2 and self._lead_shape is not None:
            b, t = self._lead_shape
            if tensor.shape[0] == b * t:
                tensor = tensor.view(b, t, tensor.shape[-1])
        self.keys_by_spec[spec] = tensor.detach().clone() if self.detach else tensor
        if self.stop_after and self._running and all(k is not None for k in self.keys_by_spec.values()):
            raise _StopForward

    def _make_hook(self, spec: KeySpec, kind: str) -> Any:
        if kind == "pre":

            def pre_hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                self.store(spec, _input_tensor(args, kwargs))

            return pre_hook

        def post_hook(_m: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            self.store(spec, _first_tensor(output))

        return post_hook

    def _raw_hooks(self, spec: KeySpec, ffn: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Hooks for ``ffn_in_raw``: remember each norm-like child's (output -> input), then, when the FFN runs,
        store the input of the child whose output is the FFN's input tensor."""
        norm = spec.normalized(num_layers(self.model))
        candidates = _layer_parts(self.model, norm.layer)[0].norms
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []

        def remember(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            x, y = _input_tensor(args, kwargs), _first_tensor(output)
            if x is not None and y is not None:
                seen.append((y, x))

        def at_ffn(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            h = _input_tensor(args, kwargs)
            match = next((x for y, x in reversed(seen) if y is h), None)
            seen.clear()
            if match is None:
                raise MemlmError(
                    f"cannot find the norm in front of the feed-forward block of layer {norm.layer} of "
                    f"{type(self.model).__name__} (its input is not the output of a norm of the layer); "
                    "use key role 'ffn_in' (after the norm) or 'block_out'"
                )
            self.store(spec, match)

        handles = [c.register_forward_hook(remember, with_kwargs=True) for c in candidates]
        handles.append(ffn.register_forward_pre_hook(at_ffn, with_kwargs=True))
        return handles

    def _record_lead_shape(self, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = _input_tensor(args, kwargs)
        if hidden is not None and hidden.ndim == 3:
            self._lead_shape = (int(hidden.shape[0]), int(hidden.shape[1]))

    def __enter__(self) -> KeyCapture:
        if self._handles:
            raise MemlmError("this KeyCapture is already active; use a separate KeyCapture per `with` block")
        try:
            first_layer = find_decoder_layers(self.model)[0]
            self._handles.append(first_layer.register_forward_pre_hook(self._record_lead_shape, with_kwargs=True))
            for spec, (module, kind) in zip(self.specs, self._targets, strict=True):
                if kind == "raw":
                    self._handles.extend(self._raw_hooks(spec, module))
                    continue
                hook = self._make_hook(spec, kind)
                if kind == "pre":
                    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
                else:
                    handle = module.register_forward_hook(hook)
                self._handles.append(handle)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._lead_shape = None

    # -- driving the model ---------------------------------------------------------------------------------
    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model, clearing old keys first; with ``stop_after`` the pass ends early (returns None)."""
        if not self._handles:
            raise MemlmError(
                "KeyCapture.run() needs the hooks installed; call it inside `with KeyCapture(...) as cap:`"
            )
        self.clear()
        self._running = True
        try:
            return self.model(*args, **kwargs)
        except _StopForward:
            return None
        finally:
            self._running = False
