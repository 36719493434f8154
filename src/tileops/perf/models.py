"""Model-shape coverage as data: the GEMM, attention, norm, activation and loss workloads of
public models.

`models.yaml` holds public model configs. From them this module derives every Linear layer
(as GemmFwdOp workloads at several token counts), every attention configuration (as
GroupedQueryAttentionFwdOp / BwdOp workloads at several sequence lengths), every norm (by
the model's norm type: the residual stream's, Qwen3 / Gemma-3 q/k norms, DeepSeek-V3's latent
norms), the gated activation (by hidden_act) and the LM head's loss (by vocabulary),
deduplicated
across models, in the manifest's workload form, so `bench_workload` times them like
manifest rows. A workload also carries `sources` (every "model layer" it stands for),
`models` and `config` (what it is, without the token count).

Deriving reads YAML only (no torch). `refusal` asks an Op's own checks, on meta tensors,
whether it takes a workload: a shape the kernels do not serve yet stays in the list,
marked, so the tier shows what is unsupported.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

from ..errors import TileOpsError, TileOpsValueError

MODELS_FILE = pathlib.Path(__file__).with_name("models.yaml")

GEMM_OP = "GemmFwdOp"
ATTENTION_FWD_OP = "GroupedQueryAttentionFwdOp"
ATTENTION_BWD_OP = "GroupedQueryAttentionBwdOp"
# the layer and loss ops, derived from hidden / intermediate / vocab sizes (see _layer_rows)
NORM_OPS = ("RMSNormFwdOp", "RMSNormBwdOp", "FusedAddRMSNormFwdOp", "LayerNormFwdOp",
            "LayerNormBwdOp")
ACTIVATION_OPS = ("SiluAndMulFwdOp", "SiluAndMulBwdOp", "GeluAndMulFwdOp", "GeluAndMulBwdOp")
LOSS_OPS = ("CrossEntropyFwdOp", "CrossEntropyWithGradFwdOp", "CrossEntropyBwdOp",
            "FusedLinearCrossEntropyFwdOp")
MODEL_OPS = (GEMM_OP, ATTENTION_FWD_OP, ATTENTION_BWD_OP, *NORM_OPS, *ACTIVATION_OPS,
             *LOSS_OPS)
TRAINING_TOKENS = (4096, 16384)  # backward and loss workloads: training steps only

# GEMM M: one decode token up to a long prefill or a training micro-batch.
TOKEN_COUNTS = (1, 8, 64, 512, 4096, 16384)
# Attention: batch x sequence keeps this many tokens in flight, so every length fills the
# GPU alike; the forward adds the longest context at batch 1 for models that reach it.
TOKENS_IN_FLIGHT = 32768
FORWARD_SEQS = (512, 2048, 8192, 32768)
BACKWARD_SEQS = (2048, 8192, 32768)  # training lengths; 128K backward is not a 1-GPU job
LONG_SEQ = 131072

DTYPES = ["bfloat16", "float16"]  # what a workload may run in (`--dtype` picks)
DEFAULT_DTYPES = ["bfloat16"]  # what the tier runs unless told: fp16 takes the same kernels

_REQUIRED = ("source", "kind", "hidden", "mlp", "norm", "act", "heads", "kv_heads",
             "head_dim", "layers", "qkv", "gate_up")


# -- configs ----------------------------------------------------------------------------------

@functools.cache
def load_models(path: pathlib.Path = MODELS_FILE) -> dict[str, dict[str, Any]]:
    """The model configs, by name, in file order; checked for the fields derivation reads."""
    data = yaml.safe_load(path.read_text())
    for name, cfg in data.items():
        missing = [f for f in _REQUIRED if f not in cfg]
        if missing:
            raise TileOpsValueError(f"{path.name}: model {name!r}: missing {missing}")
        if cfg["kind"] not in ("decoder", "encoder"):
            raise TileOpsValueError(f"{path.name}: model {name!r}: kind must be decoder or "
                                    f"encoder, got {cfg['kind']!r}")
        if cfg["kind"] == "encoder" and "seq_len" not in cfg:
            raise TileOpsValueError(f"{path.name}: model {name!r}: an encoder needs seq_len")
        if cfg["kind"] == "decoder" and "context" not in cfg:
            raise TileOpsValueError(f"{path.name}: model {name!r}: a decoder needs context")
    return data


def select_models(texts: Sequence[str] | None = None) -> list[str]:
    """Model names containing one of `texts` (all models for None)."""
    return [n for n in load_models() if not texts or any(t in n for t in texts)]


# -- Linear layers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Linear:
    """One Linear layer: y[M, n] = x[M, k] @ weight[n, k]^T."""

    name: str
    n: int
    k: int


def linear_layers(cfg: dict[str, Any]) -> list[Linear]:
    """Every dense Linear of one model: the checkpoint's own layout and, where it keeps
    q/k/v or gate/up apart, the fused forms serving engines run instead."""
    h = cfg["hidden"]
    layers = _attention_linears(cfg)
    inter = cfg.get("intermediate")
    if inter:
        layers += _mlp_linears("", cfg, inter)
    moe = cfg.get("moe")
    if moe:
        layers.append(Linear("router", moe["experts"], h))
        if moe.get("shared_experts"):
            layers += _mlp_linears("shared_expert.", cfg,
                                   moe["shared_experts"] * moe["expert_intermediate"])
    if cfg.get("vocab"):
        layers.append(Linear("lm_head", cfg["vocab"], h))
    return layers


def _attention_linears(cfg: dict[str, Any]) -> list[Linear]:
    h, heads, kv_heads = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
    mla = cfg.get("mla")
    if mla:  # DeepSeek-V3: queries and keys/values go through low-rank latents
        rope, nope, v = mla["qk_rope_head_dim"], mla["qk_nope_head_dim"], mla["v_head_dim"]
        return [Linear("q_a_proj", mla["q_lora_rank"], h),
                Linear("q_b_proj", heads * (nope + rope), mla["q_lora_rank"]),
                Linear("kv_a_proj_with_mqa", mla["kv_lora_rank"] + rope, h),
                Linear("kv_b_proj", heads * (nope + v), mla["kv_lora_rank"]),
                Linear("fused_qkv_a_proj", mla["q_lora_rank"] + mla["kv_lora_rank"] + rope, h),
                Linear("o_proj", h, heads * v)]
    q = heads * cfg["head_dim"]
    kv = kv_heads * cfg["head_dim"]
    layers = [Linear("qkv_proj", q + 2 * kv, h)]
    if cfg["qkv"] == "separate":
        layers += [Linear("q_proj", q, h), Linear("k_proj", kv, h), Linear("v_proj", kv, h)]
    return layers + [Linear("o_proj", h, q)]


def _mlp_linears(prefix: str, cfg: dict[str, Any], inter: int) -> list[Linear]:
    h = cfg["hidden"]
    if cfg["mlp"] == "plain":
        return [Linear(f"{prefix}fc1", inter, h), Linear(f"{prefix}fc2", h, inter)]
    layers = [Linear(f"{prefix}gate_up_proj", 2 * inter, h)]
    if cfg["gate_up"] == "separate":
        layers += [Linear(f"{prefix}gate_proj", inter, h), Linear(f"{prefix}up_proj", inter, h)]
    return layers + [Linear(f"{prefix}down_proj", h, inter)]


def token_counts(cfg: dict[str, Any]) -> list[int]:
    """GEMM M values for one model: an encoder runs whole sequences, so none below one."""
    floor = cfg["seq_len"] if cfg["kind"] == "encoder" else 1
    return [t for t in TOKEN_COUNTS if t >= floor]


# -- attention configurations -----------------------------------------------------------------

@dataclass(frozen=True)
class Attention:
    """One attention configuration of a model's layers."""

    heads: int
    kv_heads: int
    head_dim: int  # q and k
    v_head_dim: int
    causal: bool
    window: int | None = None  # keys a query sees, itself included
    softcap: float = 0.0
    scale: float | None = None  # None: head_dim ** -0.5
    layer: str = ""  # "local" / "global" where a model interleaves them

    def params(self) -> dict[str, Any]:
        """The attention Ops' params (the manifest's names); defaults left out."""
        params: dict[str, Any] = {"is_causal": self.causal}
        if self.window:  # the window counts the query itself: window_size[0] keys before it
            params["window_size"] = [self.window - 1, 0]
        if self.softcap:
            params["softcap"] = float(self.softcap)
        if self.scale is not None:
            params["scale"] = self.scale
        return params

    def describe(self) -> str:
        """E.g. '32/8 heads, head_dim 128, causal, window 4096'."""
        dims = (f"head_dim {self.head_dim}" if self.v_head_dim == self.head_dim
                else f"head_dim {self.head_dim} (q/k) / {self.v_head_dim} (v)")
        parts = [f"{self.heads}/{self.kv_heads} heads", dims,
                 "causal" if self.causal else "bidirectional"]
        if self.window:
            parts.append(f"window {self.window}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.scale is not None:
            parts.append(f"scale {self.scale:.4g}")
        return ", ".join(parts)


def attention_configs(cfg: dict[str, Any]) -> list[Attention]:
    """The attention configurations of one model's layers (one, or local and global)."""
    scalar = cfg.get("query_pre_attn_scalar")
    scale = scalar ** -0.5 if scalar and scalar != cfg["head_dim"] else None
    base = Attention(cfg["heads"], cfg["kv_heads"], cfg["head_dim"],
                     cfg.get("v_head_dim") or cfg["head_dim"], cfg["kind"] == "decoder",
                     softcap=cfg.get("softcap") or 0.0, scale=scale)
    window = cfg.get("sliding_window")
    if not window:
        return [base]
    if not cfg.get("global_layers"):
        return [replace(base, window=window)]
    return [replace(base, window=window, layer="local"), replace(base, layer="global")]


def sequence_plan(cfg: dict[str, Any], backward: bool) -> list[tuple[int, int]]:
    """(batch, sequence length) pairs for one model's attention workloads."""
    if cfg["kind"] == "encoder":
        return [(max(1, TOKENS_IN_FLIGHT // cfg["seq_len"]), cfg["seq_len"])]
    context = cfg["context"]
    seqs = [s for s in (BACKWARD_SEQS if backward else FORWARD_SEQS) if s <= context]
    if context < max(FORWARD_SEQS) and context not in seqs:
        seqs.append(context)  # a short-context model at its full length
    plan = [(max(1, TOKENS_IN_FLIGHT // s), s) for s in seqs]
    if not backward and context >= LONG_SEQ:
        plan.append((1, LONG_SEQ))
    return plan


# -- workloads --------------------------------------------------------------------------------

def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _gemm_workloads(name: str, cfg: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    for layer in linear_layers(cfg):
        for m in token_counts(cfg):
            yield f"{name} {layer.name} {m} tokens", {
                "inputs": {"a": [m, layer.k], "b": [layer.n, layer.k]},
                "config": f"N={layer.n} K={layer.k}", "tokens": m}


def _attention_workloads(name: str, cfg: dict[str, Any],
                         backward: bool) -> Iterable[tuple[str, dict[str, Any]]]:
    stage = "training" if backward else "prefill" if cfg["kind"] == "decoder" else "batch"
    for att in attention_configs(cfg):
        mask = "causal" if att.causal else "bidirectional"
        if att.layer:
            mask = f"{att.layer} layer " + mask
        if att.window:
            mask += f" window {att.window}"
        for batch, seq in sequence_plan(cfg, backward):
            q = [batch, seq, att.heads, att.head_dim]
            k = [batch, seq, att.kv_heads, att.head_dim]
            v = [batch, seq, att.kv_heads, att.v_head_dim]
            o = [batch, seq, att.heads, att.v_head_dim]
            inputs = ({"do": o, "q": q, "k": k, "v": v, "o": o, "lse": [batch, att.heads, seq]}
                      if backward else {"q": q, "k": k, "v": v})
            yield f"{name} {stage} {batch} x {_k(seq)} {mask}", {
                "inputs": inputs, "params": att.params(), "config": att.describe(),
                "tokens": batch * seq}


def _norm_rows(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(what, rows per token, normalized size) of every norm of one model's layers."""
    rows = [("norm", 1, cfg["hidden"])]
    if cfg.get("qk_norm"):
        rows += [("q_norm", cfg["heads"], cfg["head_dim"]),
                 ("k_norm", cfg["kv_heads"], cfg["head_dim"])]
    mla = cfg.get("mla")
    if mla:  # the low-rank latents are RMS-normalized too
        rows += [("q_a_layernorm", 1, mla["q_lora_rank"]),
                 ("kv_a_layernorm", 1, mla["kv_lora_rank"])]
    return rows


def _layer_workloads(op_name: str, name: str,
                     cfg: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    """Norms, gated activations and the loss, from the sizes of one model."""
    training = op_name.endswith("BwdOp") or op_name in LOSS_OPS
    tokens = [t for t in token_counts(cfg) if not training or t in TRAINING_TOKENS]
    if op_name in NORM_OPS:
        if (cfg["norm"] == "rms") != op_name.startswith(("RMSNorm", "FusedAddRMSNorm")):
            return
        for what, per_token, n in _norm_rows(cfg):
            if op_name.startswith("FusedAdd") and what != "norm":
                continue  # only the residual stream's norms take the fused add
            for t in tokens:
                x, label = [t * per_token, n], f"{name} {what} {t} tokens"
                if op_name.startswith("FusedAdd"):
                    inputs = {"input": x, "residual": x, "weight": [n]}
                    yield label, {"inputs": inputs, "config": f"hidden {n}", "tokens": t}
                    continue
                inputs = {"input": x, "weight": [n]}
                if op_name.startswith("LayerNorm"):
                    inputs["bias"] = [n]
                if op_name.endswith("BwdOp"):
                    inputs = {"grad_output": x, **inputs}
                yield label, {"inputs": inputs, "params": {"normalized_shape": [n]},
                              "config": f"normalized {n}", "tokens": t}
        return
    if op_name in ACTIVATION_OPS:
        act = "silu" if op_name.startswith("Silu") else "gelu_tanh"
        inter = cfg.get("intermediate")
        if cfg["mlp"] != "gated" or cfg["act"] != act or not inter:
            return
        params = {} if act == "silu" else {"approximate": "tanh"}
        for t in tokens:
            inputs = {"x": [t, 2 * inter]}
            if op_name.endswith("BwdOp"):
                inputs = {"grad_out": [t, inter], **inputs}
            yield f"{name} mlp {t} tokens", {"inputs": inputs, "params": params,
                                             "config": f"intermediate {inter}", "tokens": t}
        return
    vocab = cfg.get("vocab")
    if not vocab or cfg["kind"] != "decoder":
        return
    for t in tokens:
        if op_name == "FusedLinearCrossEntropyFwdOp":
            inputs = {"hidden": [t, cfg["hidden"]], "weight": [vocab, cfg["hidden"]],
                      "target": [t]}
        else:
            inputs = {"input": [t, vocab], "target": [t]}
            if op_name == "CrossEntropyBwdOp":
                inputs = {"grad_loss": [1], **inputs, "lse": [t]}
        yield f"{name} lm head loss {t} tokens", {"inputs": inputs, "config": f"vocab {vocab}",
                                                 "tokens": t}


def _derive(op_name: str, name: str,
            cfg: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    if op_name == GEMM_OP:
        return _gemm_workloads(name, cfg)
    if op_name in (ATTENTION_FWD_OP, ATTENTION_BWD_OP):
        return _attention_workloads(name, cfg, backward=op_name == ATTENTION_BWD_OP)
    if op_name in NORM_OPS + ACTIVATION_OPS + LOSS_OPS:
        return _layer_workloads(op_name, name, cfg)
    raise TileOpsValueError(f"the models tier has no workloads for {op_name}; it covers "
                            f"{', '.join(MODEL_OPS)}")


@functools.cache
def _all_workloads(op_name: str) -> tuple[dict[str, Any], ...]:
    """Every model's workloads for `op_name`, deduplicated: a shape (with its params) that
    several models or layers share is one workload whose `sources` names them all. The label
    is its first source's, plus how many more, so it does not change with a --models filter.
    """
    merged: dict[str, dict[str, Any]] = {}
    for name, cfg in load_models().items():
        for source, w in _derive(op_name, name, cfg):
            key = json.dumps([w["inputs"], w.get("params", {})], sort_keys=True)
            if key not in merged:
                merged[key] = {"label": source, **w, "dtypes": list(DTYPES),
                               "sources": [], "models": []}
            entry = merged[key]
            entry["sources"].append(source)
            if name not in entry["models"]:
                entry["models"].append(name)
    for w in merged.values():
        if len(w["sources"]) > 1:
            w["label"] += f" (+{len(w['sources']) - 1} more)"
    return tuple(merged.values())


def model_workloads(op_name: str, models: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The deduplicated workloads of `op_name` from every model whose name contains one of
    `models` (all models for None), as manifest-style dicts (copies: callers may edit)."""
    wanted = set(select_models(models))
    return [json.loads(json.dumps(w)) for w in _all_workloads(op_name)
            if wanted.intersection(w["models"])]


# -- what the current Ops refuse --------------------------------------------------------------

def refusal(op_cls: Any, workload: dict[str, Any]) -> str | None:
    """Why `op_cls` refuses `workload` (its own checks, on meta tensors), or None."""
    spec = op_cls.spec
    try:
        op = op_cls(**spec.workload_params(workload))
        for dtype in workload["dtypes"]:
            tensors = spec.workload_tensors(workload, dtype)
            op.check([tensors[n] for n in spec.input_names])
    except TileOpsError as e:
        return str(e)
    return None


def split_refused(op_cls: Any, workloads: Iterable[dict[str, Any]]
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the workloads `op_cls` accepts, one record per refused one: op, label, config,
    models, reason) - the records are what the report lists."""
    accepted, refused = [], []
    for w in workloads:
        reason = refusal(op_cls, w)
        if reason is None:
            accepted.append(w)
        else:
            refused.append({"op": op_cls.__name__, "label": w["label"], "config": w["config"],
                            "models": w["models"], "reason": reason})
    return accepted, refused
