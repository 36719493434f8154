"""Tiny random transformers configs of each family that tileops.transformers patches (shared
by the CPU and GPU tests of the Hugging Face drop-in). Import only where transformers is
installed."""

from __future__ import annotations

import torch
import transformers

# family -> (config class, causal-LM class, config kwargs). Sizes keep every op's rules
# (head_dim 64 or 128, widths multiples of 8 / 64) and let a CPU run take milliseconds;
# windows shorter than the test sequences exercise the sliding-window path.
_COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=512, tie_word_embeddings=False)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": 16, "query_pre_attn_scalar": 64,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 16, "query_pre_attn_scalar": 64,
                "layer_types": ["sliding_attention", "full_attention"]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}),
    # multi-head latent attention (q/k 192 = 128 + 64 rope, v 128; interleaved rotary pairs),
    # a dense first layer, then sigmoid-routed grouped top-k experts beside a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_key_value_heads": 4, "head_dim": 64, "q_lora_rank": 128,
                     "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                     "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "rope_interleave": True}),
}

# families whose attention needs the eager reference (SDPA refuses softcap)
EAGER_REFERENCE = {"gemma2"}


def config(family: str, **overrides):
    cls_name, _, extra = FAMILIES[family]
    kwargs = {**_COMMON, **extra, **overrides}
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg._attn_implementation = "eager" if family in EAGER_REFERENCE else "sdpa"
    return cfg


def model(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
          **overrides) -> torch.nn.Module:
    """A random-init causal LM (weights drawn with std 0.02 and, for norms, around their
    identity so that every layer's output stays O(1))."""
    torch.manual_seed(seed)
    cfg = config(family, **overrides)
    m = getattr(transformers, FAMILIES[family][1])(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:  # Gemma's (1 + w) norms start at w = 0: draw around both
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                # MoE routers: logits a few units apart, so that a rounding difference between
                # two runs seldom flips a token's top-k experts
                p.normal_(0.0, 0.2)
    return m.to(device=device, dtype=dtype)
