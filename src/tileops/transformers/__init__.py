"""Hugging Face transformers (5.x) drop-in: `tileops.transformers.apply(model)`.

    import tileops.transformers
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16).cuda()
    report = tileops.transformers.apply(model)   # or apply_to_llama(model), ...
    print(report)                                # what runs on TileOPs, what stays on PyTorch

What each flag replaces, per instance of the model (other models in the process are
untouched):
- rms_norm: every *RMSNorm module (Qwen3's q_norm/k_norm included) -> tileops.rms_norm;
  Gemma's (1 + weight) scale is formed in fp32 and passed as the weight.
- rope: each attention module's apply_rotary_pos_emb -> tileops.apply_rotary (the module's
  forward is a copy of its class's whose global `apply_rotary_pos_emb` is TileOPs').
- attention: config._attn_implementation = "tileops", registered in transformers'
  AttentionInterface and AttentionMaskInterface: tileops.attention (GQA, causal, sliding
  window, softcap) when no explicit mask is needed; tileops.decode_attention /
  chunked_prefill_attention on a static KV cache without padding (read in place, see
  static_cache.py); SDPA (eager for softcapped layers) on padded batches.
- mlp: gated MLPs -> down_proj(tileops.swiglu(gate_proj(x), up_proj(x))) for SiLU,
  tileops.geglu(..., approximate='tanh') for Gemma's GeLU-tanh (exact 'gelu' too).
- cross_entropy: in training with labels, the causal LM's loss through
  fused_linear_cross_entropy on the final hidden states (logits are not materialized and
  the output's `logits` is None); Gemma-2's final logit softcap is applied in the loss.
- moe: each *Experts module (fused weights gate_up_proj [E, 2F, H], down_proj [E, H, F],
  SiLU) -> tileops.fused_moe on the top-k ids and weights of the model's own router (so
  the router's gradient is transformers'; DeepSeek-V3's sigmoid grouped router included).
- linear: "decode" (the default) puts the nn.Linear calls of up to 16 tokens (decode steps)
  on tileops.linear, whose weight-streaming GEMM serves them at cuBLAS speed or better, when
  the step is compiled or captured into a CUDA graph (eager steps are bound by host time,
  where F.linear's call is cheaper); larger calls stay on F.linear; True every call; False
  none.

The patched forwards fall back to the original forward on inputs TileOPs does not serve
(fp32 activations, mismatched dtypes), so a patched model computes what the original does.
Unsupported model families raise TileOpsUnsupportedError; requested parts that stay on
PyTorch are listed in the returned PatchReport and warned about (strict=True raises instead,
before patching anything). `revert(model)` undoes `apply`.

transformers is an optional dependency (`pip install 'tileops[hf]'`); this module imports
it only inside the functions that need it.
"""

from __future__ import annotations

from typing import Any

from ._patch import FAMILIES, Family, PatchReport, apply, family_of, revert

__all__ = ["apply", "revert", "PatchReport", "Family", "FAMILIES", "family_of",
           "apply_to_llama", "apply_to_mistral", "apply_to_qwen2", "apply_to_qwen3",
           "apply_to_gemma", "apply_to_gemma2", "apply_to_gemma3", "apply_to_mixtral",
           "apply_to_qwen3_moe", "apply_to_deepseek_v3"]


def _for(name: str, *model_types: str):
    def helper(model: Any, **flags: Any) -> PatchReport:
        from ..errors import TileOpsUnsupportedError

        found = getattr(getattr(model, "config", None), "model_type", None)
        if found not in model_types:
            raise TileOpsUnsupportedError(
                f"tileops.transformers.apply_to_{name}: argument 'model': expected "
                f"a model of model_type {' or '.join(map(repr, model_types))}, got "
                f"{type(model).__name__} (model_type {found!r}); nothing was patched")
        return apply(model, **flags)

    helper.__name__ = helper.__qualname__ = f"apply_to_{name}"
    helper.__doc__ = (f"`apply` for {', '.join(model_types)} models (refuses any other "
                      "model_type); same flags as `apply`.")
    return helper


apply_to_llama = _for("llama", "llama")
apply_to_mistral = _for("mistral", "mistral")
apply_to_qwen2 = _for("qwen2", "qwen2")
apply_to_qwen3 = _for("qwen3", "qwen3")
apply_to_gemma = _for("gemma", "gemma")
apply_to_gemma2 = _for("gemma2", "gemma2")
apply_to_gemma3 = _for("gemma3", "gemma3_text")
apply_to_mixtral = _for("mixtral", "mixtral")
apply_to_qwen3_moe = _for("qwen3_moe", "qwen3_moe")
apply_to_deepseek_v3 = _for("deepseek_v3", "deepseek_v3")
