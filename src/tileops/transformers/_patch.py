"""Patching a transformers 5.x causal LM onto TileOPs ops: what is replaced, and how.

Every replacement is per instance (an instance attribute `forward`, or the model's
`config._attn_implementation`): other models of the same class in the process, a reference
copy included, keep running transformers' code. Each patched forward falls back to the
original forward where its op cannot serve a call (fp32 activations, a weight in another
dtype than the activations), so a patched model computes what the original does, on
TileOPs where the kernels serve it. What is not patched is named in the returned
`PatchReport` (and raised as TileOpsUnsupportedError under strict=True).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import TileOpsError, TileOpsUnsupportedError, TileOpsValueError
from . import attention as attn_impl
from . import static_cache

KINDS = ("rms_norm", "rope", "attention", "mlp", "cross_entropy", "moe", "linear")
_MARK = "_tileops_patch"  # instance attribute: the patch kind applied to this module
_KERNEL_DTYPES = attn_impl.KERNEL_DTYPES


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers model family maps onto TileOPs."""

    name: str
    gemma_norm: bool = False  # RMSNorm scales by (1 + weight), in fp32 before the cast
    gelu_mlp: bool = False  # a GeLU-tanh MLP (geglu; the act_fn module decides)
    moe: bool = False  # sparse MoE blocks: their experts module runs tileops.fused_moe


# model_type -> family; model_types of one family share its handling
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama"), Family("mistral"), Family("qwen2"), Family("qwen3"),
    Family("gemma", gemma_norm=True, gelu_mlp=True),
    Family("gemma2", gemma_norm=True, gelu_mlp=True),
    Family("gemma3_text", gemma_norm=True, gelu_mlp=True),
    Family("mixtral", moe=True), Family("qwen3_moe", moe=True), Family("qwen2_moe", moe=True),
    # multi-head latent attention: q/k heads of qk_nope + qk_rope dims, v of v_head_dim, the
    # rotary part (qk_rope dims) on the queries' heads and one shared key head
    Family("deepseek_v3", moe=True),
)}


@dataclasses.dataclass
class PatchReport:
    """What `apply` did: `patched[kind]` lists module names, `unpatched` (kind, name, why)."""

    model: str
    family: str
    patched: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    unpatched: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def add(self, kind: str, name: str) -> None:
        self.patched.setdefault(kind, []).append(name)

    def skip(self, kind: str, name: str, why: str) -> None:
        self.unpatched.append((kind, name, why))

    def summary(self) -> str:
        lines = [f"tileops.transformers.apply({self.model}, family {self.family}):"]
        for kind, names in self.patched.items():
            lines.append(f"  patched {kind}: {len(names)} module(s)")
        reasons: dict[tuple[str, str], list[str]] = {}
        for kind, name, why in self.unpatched:
            reasons.setdefault((kind, why), []).append(name)
        for (kind, why), names in reasons.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                            else "")
            lines.append(f"  left on PyTorch {kind}: {shown}: {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# -- per-instance forwards ------------------------------------------------------------------
def _set_forward(module: torch.nn.Module, kind: str, fn: Callable) -> None:
    """Binds `fn` as the instance's forward, with the class forward's signature (transformers'
    generate reads the model's forward signature: attention_mask, logits_to_keep, ...)."""
    original = type(module).forward
    if getattr(fn, "__code__", None) is not getattr(original, "__code__", None):
        patched = fn

        @functools.wraps(original)
        def fn(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return patched(self, *args, **kwargs)

    module.forward = types.MethodType(fn, module)
    setattr(module, _MARK, kind)


def _original(module: torch.nn.Module) -> Callable:
    return types.MethodType(type(module).forward, module)


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if not attn_impl.served(hidden_states, weight):
        return type(self).forward(self, hidden_states)  # fp32, mixed or CPU: transformers
    from ..ops import rms_norm

    return rms_norm(hidden_states, hidden_states.shape[-1], weight, _eps(self))


def _gemma_rms_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Gemma's x / rms(x) * (1 + weight): the scale 1 + weight is formed in fp32 and rounded
    to the activation dtype once (the kernel reads a weight of the input's dtype)."""
    if not attn_impl.served(x):
        return type(self).forward(self, x)
    from ..ops import rms_norm

    scale = (1.0 + self.weight.float()).to(x.dtype)
    return rms_norm(x, x.shape[-1], scale, _eps(self))


def _eps(norm: torch.nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if value is not None:
            return float(value)
    raise TileOpsUnsupportedError(f"{type(norm).__name__}: no 'variance_epsilon' or 'eps'")


def _private(projection: torch.nn.Module) -> bool:
    """Whether a projection's output is the MLP's own: no forward hook can keep it (the
    activation's backward then overwrites it with its gradient)."""
    return not (projection._forward_hooks or torch.nn.modules.module._global_forward_hooks)


def _gated_mlp(self: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not attn_impl.served(gate, up):
        return self.down_proj(self.act_fn(gate) * up)
    from .. import ops

    # the projections' outputs are the MLP's own unless a hook may have kept them: then the
    # activation's backward writes their gradients over them (224 MiB a Llama-3.1-8B layer
    # at 4K tokens, live at the training step's peak otherwise)
    reuse = _private(self.gate_proj) and _private(self.up_proj)
    if activation == "silu":
        return self.down_proj(ops.swiglu(gate, up, reuse_inputs=reuse))
    return self.down_proj(ops.geglu(gate, up, approximate=_APPROXIMATE[activation],
                                    reuse_inputs=reuse))


def _swiglu_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _gated_mlp(self, x, "silu")


# class of the MLP's act_fn (transformers' ACT2FN: the module, not the config, says what
# runs: Gemma-1 reads hidden_act, Gemma-2/3 hidden_activation) -> the gated op, its params
_GATED = {"SiLUActivation": ("swiglu", {}), "SiLU": ("swiglu", {}),
          "GELUActivation": ("geglu", {"approximate": "none"}),  # gelu (erf)
          "GELUTanh": ("geglu", {"approximate": "tanh"}),  # gelu_pytorch_tanh
          "PytorchGELUTanh": ("geglu", {"approximate": "tanh"}),  # its older name
          "NewGELUActivation": ("geglu", {"approximate": "tanh"})}  # gelu_new: same formula


def _make_geglu_mlp_forward(approximate: str) -> Callable:
    activation = _GELU_ACTIVATIONS[approximate]

    def _geglu_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _gated_mlp(self, x, activation)

    return _geglu_mlp_forward


_GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}
_APPROXIMATE = {v: k for k, v in _GELU_ACTIVATIONS.items()}
_GEGLU_FORWARDS = {a: _make_geglu_mlp_forward(a) for a in ("none", "tanh")}


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not attn_impl.served(x, self.weight, self.bias):
        return F.linear(x, self.weight, self.bias)
    from ..ops import linear

    return linear(x, self.weight, self.bias)


# apply(linear="decode"): calls of up to this many tokens (decode steps) take tileops.linear,
# whose weight-streaming GEMM serves them (kernels/gemm/weight_stream.py: 0.99-1.10x cuBLAS
# on an H100), when traced by torch.compile or captured into a CUDA graph; larger calls
# (prefill, training) stay on F.linear, where TileOPs' GEMMs are not yet at cuBLAS's speed
# on every shape.
DECODE_TOKENS = 16


def _graphed() -> bool:
    """Whether this call is being traced by torch.compile or captured into a CUDA graph:
    there tileops.linear's host time per call (a few microseconds over F.linear's) is not
    paid again each step. An eager decode step is bound by host time, so its calls stay on
    F.linear, whose GEMM is within a few percent."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available()
                                             and torch.cuda.is_current_stream_capturing())


def _decode_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() > DECODE_TOKENS * x.shape[-1] or not _graphed():
        return F.linear(x, self.weight, self.bias)
    return _linear_forward(self, x)


# Sibling projections of one input: at decode sizes one tileops.linear_group launch streams
# all their weights (kernels/gemm/weight_group.py), where one launch each pays a pipeline
# fill and a tail each, and a k_proj of 8 MB never reaches HBM speed on its own. Part of
# apply(linear="decode") (Llama-3.1-8B b8 decode step under CUDA graphs, H100: 1965 us
# grouped, 2082 one launch a weight); TILEOPS_HF_GROUP_PROJECTIONS=0 turns it off.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                     ("q_a_proj", "kv_a_proj_with_mqa"))  # DeepSeek-V3's latent projections
# Grouped members take calls of up to this many tokens (linear_group's GROUP_ROWS, its
# weight-streaming buckets): at 32 and 64 tokens the grouped launch ran 1.02-1.44x one
# cuBLAS call a weight (H100, 2026-12-06; Llama-3.1-8B q/k/v 25.0 against 35.8 us).
GROUPED_TOKENS = 64


def _group_projections() -> bool:
    return os.environ.get("TILEOPS_HF_GROUP_PROJECTIONS", "1") != "0"


class _ProjectionGroup:
    """Linear layers of one module that read the same input (q/k/v, gate/up). On the decode
    route, the first member called computes every member's output in one launch and leaves
    the others' in `pending`; a member called on that same tensor takes its own from there
    (torch.compile traces this bookkeeping away: the graph holds one launch). Any other
    call runs on its own."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward_of(self, index: int) -> Callable:
        group = self

        def _grouped_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            if x.numel() > GROUPED_TOKENS * x.shape[-1] or not _graphed():
                return F.linear(x, self.weight, self.bias)
            held = group.pending.pop(index, None)
            if held is not None and held[0] is x:
                return held[1]
            weights = [m.weight for m in group.members]
            biases = None if self.bias is None else [m.bias for m in group.members]
            if not attn_impl.served(x, *weights, *(biases or ())):
                return F.linear(x, self.weight, self.bias)
            from ..ops import linear_group

            outputs = linear_group(x, weights, biases)
            for j, y in enumerate(outputs):
                if j != index:
                    group.pending[j] = (x, y)
            return outputs[index]

        return _grouped_linear_forward


def _make_rotary(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, position_ids: Any = None,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is not None or not attn_impl.served(q, k, cos, sin):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        from ..ops import apply_rotary

        if unsqueeze_dim == 1 and q.dim() == 4:
            # transformers' q and k are [B, H, S, D] views of [B, S, H, D] projections: rotate
            # them as [B, S, H, D], so that the outputs are [B, S, H, D]-contiguous and the
            # attention kernel (BSHD) reads them without a copy
            q_out, k_out = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                        unsqueeze_dim=2)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return apply_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.__tileops__ = True
    return apply_rotary_pos_emb


def _make_rotary_interleave(original: Callable, rotate_half: Callable) -> Callable:
    """DeepSeek's apply_rotary_pos_emb_interleave: pairs (x0, x1), (x2, x3), ... rotated, the
    output laid out de-interleaved (the rotated even entries, then the odd ones). That is
    the rotate-half rotation of the de-interleaved input, which `rotate_half` (the TileOPs
    apply_rotary_pos_emb) computes."""
    def apply_rotary_pos_emb_interleave(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                                        sin: torch.Tensor, position_ids: Any = None,
                                        unsqueeze_dim: int = 1) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        if position_ids is not None or not attn_impl.served(q, k, cos, sin):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

        def deinterleaved(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((x[..., 0::2], x[..., 1::2]), -1)

        return rotate_half(deinterleaved(q), deinterleaved(k), cos, sin,
                           unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb_interleave.__tileops__ = True
    return apply_rotary_pos_emb_interleave


class _Unbindable(Exception):
    pass


def _rebind_globals(fn: Callable, overrides: dict[str, Any]) -> Callable:
    """A copy of `fn` whose code reads `overrides` in place of those module globals. Through
    decorator chains (functools.wraps) whose wrapper holds the wrapped function in a closure
    cell, the chain is copied with the innermost function rebound."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        if not isinstance(fn, types.FunctionType):
            raise _Unbindable(f"{fn!r} is not a Python function")
        scope = dict(fn.__globals__)
        scope.update(overrides)
        # without __name__: torch.compile (dynamo) takes a globals dict with a __name__ for
        # that module's own and guards on the module's attributes (the original
        # apply_rotary_pos_emb), not on this copy's
        scope.pop("__name__", None)
        closure = fn.__closure__
    else:
        cells = fn.__closure__ or ()
        held = [i for i, c in enumerate(cells) if _cell(c) is inner]
        if len(held) != 1:
            raise _Unbindable(f"decorator of {fn.__qualname__} does not hold it in a closure")
        rebound = _rebind_globals(inner, overrides)
        closure = tuple(types.CellType(rebound) if i == held[0] else c
                        for i, c in enumerate(cells))
        scope = fn.__globals__
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__annotations__ = dict(getattr(fn, "__annotations__", None) or {})
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    if inner is not None:
        new.__wrapped__ = _cell(closure[held[0]])
    return new


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


# -- the causal-LM loss -----------------------------------------------------------------------
def _causal_lm_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Training with labels: the decoder's hidden states go through the fused linear
    cross-entropy (no logits; `logits` is None in the output). Anything else runs the
    model's own forward."""
    head = self.lm_head
    if len(args) > 1 or kwargs.get("labels") is None or not self.training or \
            kwargs.get("return_dict") is False or not attn_impl.served(head.weight, head.bias):
        return type(self).forward(self, *args, **kwargs)
    if args:
        kwargs["input_ids"] = args[0]
    labels = kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(**kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = _flce(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                 shift_labels.reshape(-1).to(hidden.device), self.lm_head.bias, ignore_index,
                 getattr(self.config, "final_logit_softcapping", None), num_items is not None)
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    return _lm_output(outputs, loss)


def _flce(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
          bias: torch.Tensor | None, ignore_index: int, softcap: float | None,
          summed: bool) -> torch.Tensor:
    """fused_linear_cross_entropy with the loss kept in fp32 (as transformers' loss, which
    upcasts the logits); the functional API rounds it to the hidden dtype."""
    from ..ops.fused_linear_cross_entropy import FusedLinearCrossEntropyFwdOp

    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return FusedLinearCrossEntropyFwdOp.apply(
        hidden, weight, target, bias, ignore_index=ignore_index, label_smoothing=0.0,
        softcap=None if softcap is None else float(softcap), lse_square_scale=0.0,
        reduction="sum" if summed else "mean", with_grad=wants_grad)[0]


def _lm_output(outputs: Any, loss: torch.Tensor) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    values = {"loss": loss, "logits": None,
              "hidden_states": getattr(outputs, "hidden_states", None),
              "attentions": getattr(outputs, "attentions", None)}
    found = {f.name for f in dataclasses.fields(outputs)} if dataclasses.is_dataclass(
        outputs) else set()
    cache = next((getattr(outputs, n) for n in ("cache", "past_key_values") if n in found), None)
    for name in ("cache", "past_key_values"):  # transformers 5.24 renamed the field
        if name in fields:
            values[name] = cache
    return CausalLMOutputWithPast(**{k: v for k, v in values.items() if k in fields})


# -- probes: will the op serve this module's shapes? ------------------------------------------
def _probe(fn: Callable, *args: Any, **kwargs: Any) -> str | None:
    """None when `fn` accepts meta tensors of the model's shapes, else the op's message."""
    try:
        fn(*args, **kwargs)
    except TileOpsError as e:
        return str(e)
    return None


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.bfloat16


def _probe_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 models are probed as bf16: under autocast their activations are bf16, and in fp32
    every patched forward falls back to PyTorch at run time."""
    return dtype if dtype in _KERNEL_DTYPES else torch.bfloat16


# -- apply ------------------------------------------------------------------------------------
def family_of(model: torch.nn.Module) -> Family:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise TileOpsUnsupportedError(
            f"tileops.transformers.apply: argument 'model': expected a causal LM of a "
            f"supported family ({', '.join(sorted(FAMILIES))}), got {type(model).__name__} "
            f"(model_type {model_type!r}); nothing was patched")
    return family


def apply(model: torch.nn.Module, rms_norm: bool = True, rope: bool = True,
          attention: bool = True, mlp: bool = True, cross_entropy: bool = True,
          moe: bool = True, linear: bool | str = "decode", strict: bool = False,
          verbose: bool = True) -> PatchReport:
    """Patches `model` (a transformers 5.x causal LM or its base model) in place onto TileOPs
    ops; returns the PatchReport. `linear`: True puts every nn.Linear call on
    tileops.linear, "decode" (the default) the calls of up to DECODE_TOKENS tokens traced by
    torch.compile or captured into a CUDA graph (`_graphed`), False none. Applying twice
    patches nothing new. Requested parts that stay on PyTorch are listed in the report,
    warned about (verbose) or, with strict=True, raised as TileOpsUnsupportedError before
    anything is patched."""
    family = family_of(model)
    report = PatchReport(type(model).__name__, family.name)
    plan: list[Callable[[], None]] = []
    if linear not in (True, False, "decode"):
        raise TileOpsValueError(
            f"tileops.transformers.apply: argument 'linear': expected True, False or "
            f"'decode', got {linear!r}")
    want = {"rms_norm": rms_norm, "rope": rope, "attention": attention, "mlp": mlp,
            "cross_entropy": cross_entropy, "moe": moe, "linear": linear}
    dtype = _probe_dtype(_model_dtype(model))
    config = model.config
    probe_cache: dict[tuple, str | None] = {}

    def probe(key: tuple, fn: Callable, *args: Any, **kwargs: Any) -> str | None:
        if key not in probe_cache:
            probe_cache[key] = _probe(fn, *args, **kwargs)
        return probe_cache[key]

    if want["attention"]:
        _plan_attention(model, config, dtype, report, plan, probe)
    grouped = (_plan_projection_groups(model, dtype, report, plan, probe)
               if linear == "decode" and _group_projections() else set())
    rotary_modules: dict[str, Callable] = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        done = getattr(module, _MARK, None)
        if cls.endswith("RMSNorm") and want["rms_norm"]:
            _plan_norm(name, module, family, dtype, report, plan, probe, done)
        elif cls.endswith("Attention") and want["rope"]:
            _plan_rope(name, module, dtype, report, plan, probe, done, rotary_modules)
        elif cls.endswith("Experts") and want["moe"]:
            _plan_experts(name, module, config, dtype, report, plan, probe, done)
        elif cls.endswith("MLP") and want["mlp"]:
            _plan_mlp(name, module, family, config, dtype, report, plan, probe, done)
        elif cls.endswith("ForCausalLM") and want["cross_entropy"]:
            _plan_loss(name, module, config, dtype, report, plan, probe, done)
        if isinstance(module, torch.nn.Linear) and want["linear"] and id(module) not in grouped:
            _plan_linear(name or "model", module, dtype, report, plan, probe, done,
                         _decode_linear_forward if linear == "decode" else _linear_forward)
    if strict and report.unpatched:
        raise TileOpsUnsupportedError(
            "tileops.transformers.apply(strict=True): nothing was patched, because these "
            "requested parts would stay on PyTorch:\n" + report.summary())
    for step in plan:
        step()
    if verbose and report.unpatched:
        warnings.warn(report.summary(), stacklevel=2)
    model._tileops_report = report
    return report


def _plan_attention(model: torch.nn.Module, config: Any, dtype: torch.dtype,
                    report: PatchReport, plan: list, probe: Callable) -> None:
    current = getattr(config, "_attn_implementation", None)
    if current == attn_impl.NAME:
        return
    if getattr(config, "attention_dropout", 0.0):
        report.skip("attention", "config", f"attention_dropout {config.attention_dropout} "
                    "(the kernel has no dropout)")
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim, head_dim_v = _attention_head_dims(config)
    softcap = getattr(config, "attn_logit_softcapping", None) or 0.0
    window = getattr(config, "sliding_window", None)
    windows = {(-1, 0)} | ({(window - 1, 0)} if window else set())
    for w in sorted(windows):
        why = probe(("attention", w), _attention_probe, heads, kv_heads, head_dim, head_dim_v,
                    dtype, w, softcap)
        if why:
            report.skip("attention", "config", why)
            return

    def step() -> None:
        attn_impl.register()
        setter = getattr(model, "set_attn_implementation", None)
        if setter is not None:
            setter(attn_impl.NAME)
        if getattr(model.config, "_attn_implementation", None) != attn_impl.NAME:
            model.config._attn_implementation = attn_impl.NAME
        for sub in model.modules():  # sub-configs of nested models
            cfg = getattr(sub, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", None) != attn_impl.NAME:
                cfg._attn_implementation = attn_impl.NAME
        model._tileops_previous_attn = current
        static_cache.install(model)

    plan.append(step)
    report.add("attention", "config")


def _attention_head_dims(config: Any) -> tuple[int, int]:
    """(query/key head dim, value head dim) of the attention calls: multi-head latent
    attention's qk_nope + qk_rope and v_head_dim (its config's head_dim is the rope part
    alone), else head_dim (or hidden / heads) for both."""
    nope = getattr(config, "qk_nope_head_dim", None)
    rope = getattr(config, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        return nope + rope, getattr(config, "v_head_dim", None) or nope + rope
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    return head_dim, head_dim


def _attention_probe(heads: int, kv_heads: int, head_dim: int, head_dim_v: int,
                     dtype: torch.dtype, window: tuple[int, int], softcap: float) -> None:
    from ..ops import attention

    q = _meta(1, 128, heads, head_dim, dtype=dtype)
    k = _meta(1, 128, kv_heads, head_dim, dtype=dtype)
    v = _meta(1, 128, kv_heads, head_dim_v, dtype=dtype)
    attention(q, k, v, is_causal=True, window_size=window, softcap=softcap)


def _plan_norm(name: str, module: torch.nn.Module, family: Family, dtype: torch.dtype,
               report: PatchReport, plan: list, probe: Callable, done: Any) -> None:
    weight = getattr(module, "weight", None)
    if done == "rms_norm":
        return
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        report.skip("rms_norm", name, "no 1-D weight (a norm of another form)")
        return
    try:
        eps = _eps(module)
    except TileOpsError as e:
        report.skip("rms_norm", name, str(e))
        return
    n = weight.shape[0]
    from ..ops import rms_norm as op

    why = probe(("rms_norm", n), op, _meta(4, n, dtype=dtype), n, _meta(n, dtype=dtype), eps)
    if why:
        report.skip("rms_norm", name, why)
        return
    fn = _gemma_rms_norm_forward if family.gemma_norm else _rms_norm_forward
    plan.append(lambda: _set_forward(module, "rms_norm", fn))
    report.add("rms_norm", name)


def _plan_rope(name: str, module: torch.nn.Module, dtype: torch.dtype, report: PatchReport,
               plan: list, probe: Callable, done: Any, cache: dict[str, Callable]) -> None:
    if done == "rope":
        return
    import sys

    modeling = sys.modules.get(type(module).__module__)
    forward = type(module).forward
    code_names = set()
    f = forward
    while f is not None:
        code_names |= set(getattr(getattr(f, "__code__", None), "co_names", ()))
        f = getattr(f, "__wrapped__", None)
    # the module's rotary functions that its forward calls, each with its TileOPs form
    originals = {fn: getattr(modeling, fn, None) for fn in _ROTARY_FUNCTIONS}
    called = {fn: original for fn, original in originals.items()
              if original is not None and fn in code_names}
    if "apply_rotary_pos_emb" not in called:
        report.skip("rope", name, "its forward does not call its module's "
                    "apply_rotary_pos_emb")
        return
    shape = _rotary_shape(module)
    if shape is None:
        report.skip("rope", name, "no head_dim / num_attention_heads to check the kernel with")
        return
    why = probe(("rope",) + shape, _rope_probe, *shape, dtype)
    if why:
        report.skip("rope", name, why)
        return
    key = type(module).__qualname__ + type(module).__module__
    if key not in cache:
        rotary = _make_rotary(called["apply_rotary_pos_emb"])
        overrides = {"apply_rotary_pos_emb": rotary}
        if "apply_rotary_pos_emb_interleave" in called:
            overrides["apply_rotary_pos_emb_interleave"] = _make_rotary_interleave(
                called["apply_rotary_pos_emb_interleave"], rotary)
        try:
            cache[key] = _rebind_globals(forward, overrides)
        except _Unbindable as e:
            cache[key] = None
            report.skip("rope", name, f"cannot rebind its forward: {e}")
            return
    rebound = cache[key]
    if rebound is None:
        report.skip("rope", name, "cannot rebind its forward")
        return
    plan.append(lambda: _set_forward(module, "rope", rebound))
    report.add("rope", name)


# transformers' rotary functions, by the names the modeling files give them
_ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")


def _rotary_shape(module: torch.nn.Module) -> tuple[int, int, int] | None:
    """(query heads, key heads, rotary dims) of an attention module's rotary call, or None:
    all of head_dim on the config's heads; for multi-head latent attention (qk_rope_head_dim)
    the rope part of each query head and one key head shared by all."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    rope_dim = getattr(module, "qk_rope_head_dim", None)
    if heads is not None and rope_dim is not None:
        return heads, 1, rope_dim
    head_dim = getattr(module, "head_dim", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if head_dim is None or heads is None:
        return None
    return heads, kv_heads, head_dim


def _rope_probe(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    from ..ops import apply_rotary

    q = _meta(1, 16, heads, head_dim, dtype=dtype)  # the [B, S, H, D] form the patch runs
    k = _meta(1, 16, kv_heads, head_dim, dtype=dtype)
    cos = _meta(1, 16, head_dim, dtype=dtype)
    apply_rotary(q, k, cos, cos, unsqueeze_dim=2)


def _plan_mlp(name: str, module: torch.nn.Module, family: Family, config: Any,
              dtype: torch.dtype, report: PatchReport, plan: list, probe: Callable,
              done: Any) -> None:
    if done == "mlp":
        return
    if not all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        report.skip("mlp", name, "not a gated MLP (gate_proj, up_proj, down_proj, act_fn)")
        return
    act = type(module.act_fn).__name__
    if act not in _GATED:
        report.skip("mlp", name, f"activation {act!r}: TileOPs' two-input gated activations "
                    "are SiLU (swiglu) and GeLU, exact or tanh (geglu)")
        return
    op_name, params = _GATED[act]
    n = module.gate_proj.out_features
    from .. import ops

    why = probe(("mlp", n, act), getattr(ops, op_name), _meta(4, n, dtype=dtype),
                _meta(4, n, dtype=dtype), **params)
    if why:
        report.skip("mlp", name, why)
        return
    fn = _swiglu_mlp_forward if op_name == "swiglu" else _GEGLU_FORWARDS[params["approximate"]]
    plan.append(lambda: _set_forward(module, "mlp", fn))
    report.add("mlp", name)


def _experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call (routing done by the model's own router, so its gradient is
    transformers'): every token's top-k experts on tileops.fused_moe."""
    if not attn_impl.served(hidden_states, self.gate_up_proj, self.down_proj):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    from ..ops import fused_moe

    return fused_moe(hidden_states, self.gate_up_proj, self.down_proj,
                     topk_weights=top_k_weights.float(), topk_ids=top_k_index.int())


def _plan_experts(name: str, module: torch.nn.Module, config: Any, dtype: torch.dtype,
                  report: PatchReport, plan: list, probe: Callable, done: Any) -> None:
    if done == "moe":
        return
    try:
        from ..ops import fused_moe
    except ImportError:
        report.skip("moe", name, "this TileOPs has no fused_moe op")
        return
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gate_up.dim() == 3 and down.dim() == 3):
        report.skip("moe", name, "not fused expert weights (gate_up_proj [E, 2F, H], "
                    "down_proj [E, H, F])")
        return
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        report.skip("moe", name, "transposed or biased expert weights")
        return
    act = getattr(config, "hidden_act", None)
    experts, two_f, width = gate_up.shape
    top_k = getattr(config, "num_experts_per_tok", None)
    if act not in ("silu", "swish") or top_k is None or down.shape != (experts, width,
                                                                         two_f // 2):
        report.skip("moe", name, f"activation {act!r} / shapes {tuple(gate_up.shape)}, "
                    f"{tuple(down.shape)}: fused_moe computes SiLU experts [E, 2F, H], [E, H, F]")
        return
    why = probe(("moe", tuple(gate_up.shape), top_k), fused_moe, _meta(16, width, dtype=dtype),
                _meta(*gate_up.shape, dtype=dtype), _meta(*down.shape, dtype=dtype),
                topk_weights=_meta(16, top_k, dtype=torch.float32),
                topk_ids=torch.zeros(16, top_k, dtype=torch.int32, device="meta"))
    if why:
        report.skip("moe", name, why)
        return
    plan.append(lambda: _set_forward(module, "moe", _experts_forward))
    report.add("moe", name)


def _plan_loss(name: str, module: torch.nn.Module, config: Any, dtype: torch.dtype,
               report: PatchReport, plan: list, probe: Callable, done: Any) -> None:
    if done == "cross_entropy":
        return
    head = getattr(module, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or not hasattr(module, "model"):
        report.skip("cross_entropy", name or "model", "no lm_head Linear and base .model")
        return
    if getattr(config, "output_router_logits", False):
        report.skip("cross_entropy", name or "model", "output_router_logits adds the "
                    "router's auxiliary loss in the model's forward")
        return
    vocab, width = head.weight.shape
    softcap = getattr(config, "final_logit_softcapping", None)
    from ..ops import fused_linear_cross_entropy

    why = probe(("loss", vocab, width), fused_linear_cross_entropy, _meta(256, width,
                dtype=dtype), _meta(vocab, width, dtype=dtype),
                torch.zeros(256, dtype=torch.long, device="meta"), softcap=softcap)
    if why:
        report.skip("cross_entropy", name or "model", why)
        return
    plan.append(lambda: _set_forward(module, "cross_entropy", _causal_lm_forward))
    report.add("cross_entropy", name or "model")


def _plan_linear(name: str, module: torch.nn.Linear, dtype: torch.dtype, report: PatchReport,
                 plan: list, probe: Callable, done: Any, forward: Callable) -> None:
    if done == "linear":
        return
    if done is not None:
        report.skip("linear", name, f"already patched as {done}")
        return
    out_f, in_f = module.weight.shape
    from ..ops import linear

    bias = None if module.bias is None else _meta(out_f, dtype=dtype)
    why = probe(("linear", out_f, in_f, bias is None), linear, _meta(64, in_f, dtype=dtype),
                _meta(out_f, in_f, dtype=dtype), bias)
    if why:
        report.skip("linear", name, why)
        return
    plan.append(lambda: _set_forward(module, "linear", forward))
    report.add("linear", name)


def _plan_projection_groups(model: torch.nn.Module, dtype: torch.dtype, report: PatchReport,
                            plan: list, probe: Callable) -> set[int]:
    """Groups each module's unpatched sibling projections (PROJECTION_GROUPS) of one
    in-features and all or no biases onto one `_ProjectionGroup`; returns the ids of the
    grouped Linear modules (the rest are planned one by one)."""
    from ..ops import linear_group

    grouped: set[int] = set()
    for name, module in model.named_modules():
        for names in PROJECTION_GROUPS:
            members = [getattr(module, n, None) for n in names]
            if not all(isinstance(m, torch.nn.Linear) and getattr(m, _MARK, None) is None
                       for m in members):
                continue
            if (len({m.in_features for m in members}) != 1
                    or len({m.bias is None for m in members}) != 1):
                continue
            in_f = members[0].in_features
            biases = (None if members[0].bias is None
                      else [_meta(m.out_features, dtype=dtype) for m in members])
            if probe(("linear_group", in_f, *(m.out_features for m in members),
                      biases is None), linear_group, _meta(16, in_f, dtype=dtype),
                     [_meta(m.out_features, in_f, dtype=dtype) for m in members], biases):
                continue  # each member is planned as a Linear of its own
            group = _ProjectionGroup(members)
            for index, (member_name, member) in enumerate(zip(names, members, strict=True)):
                plan.append(functools.partial(_set_forward, member, "linear",
                                              group.forward_of(index)))
                report.add("linear", f"{name}.{member_name}" if name else member_name)
                grouped.add(id(member))
    return grouped


def revert(model: torch.nn.Module) -> None:
    """Undoes `apply`: the instance forwards are removed and the attention implementation
    set back."""
    for module in model.modules():
        if getattr(module, _MARK, None) is not None:
            module.__dict__.pop("forward", None)
            delattr(module, _MARK)
    static_cache.uninstall(model)
    previous = getattr(model, "_tileops_previous_attn", None)
    if previous is not None:
        setter = getattr(model, "set_attn_implementation", None)
        if setter is not None:
            setter(previous)
        for sub in model.modules():
            cfg = getattr(sub, "config", None)
            if cfg is not None and getattr(cfg, "_attn_implementation", None) == attn_impl.NAME:
                cfg._attn_implementation = previous
        del model._tileops_previous_attn
    model.__dict__.pop("_tileops_report", None)
