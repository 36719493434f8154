"""What a tileops-patched Llama training step keeps for backward, on meta tensors (no GPU):
the bench-model Llama-3.1-8B config (2 layers), its saved bytes per decoder layer pinned to
the closed form below (what Liger-Kernel 0.8.5 saves for the same modules, less its two
fp32 rstd rows per token), and nothing of the forward left alive after backward while the
loss is still referenced (as it is through the optimizer step, the training step's peak)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import tileops.transformers as tt  # noqa: E402
from tileops.transformers import attention as attn_impl  # noqa: E402
from tileops.transformers import bench  # noqa: E402

from .saved_tensors import account, tileops_on_meta  # noqa: E402

pytestmark = pytest.mark.smoke

SEQ = 512
LAYERS = 2


@functools.cache
def _account(patched: bool):
    model = bench.make_model("llama-3.1-8b", LAYERS, attn="sdpa", device="meta")
    model.train()
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    with tileops_on_meta():
        if patched:
            tt.apply(model, verbose=False)
        else:  # SDPA as its CUDA flash backend saves (q, k, v, out, lse)
            attn_impl.register()
            model.set_attn_implementation(attn_impl.NAME)
        return model.config, account(model, ids)


def test_patched_llama_saves_the_budget_per_layer_and_frees_it_in_backward():
    config, acc = _account(patched=True)
    h, f = config.hidden_size, config.intermediate_size
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    bf16 = 2
    per_token = (bf16 * (2 * h  # the two norms' inputs (the residual stream)
                         + h + h  # the normed inputs of q/k/v_proj and of the MLP
                         + heads * d + 2 * kv_heads * d + heads * d  # q, k, v, out (attention)
                         + 3 * f)  # gate, up (swiglu) and swiglu's output (down_proj)
                 + 4 * heads)  # the attention's fp32 lse
    rope_tables = 2 * SEQ * d * bf16  # cos, sin: one pair for every layer
    per = acc.layer_bytes()
    assert per["layers.0"] == SEQ * per_token + rope_tables, per
    assert per["layers.1"] == SEQ * per_token, per
    vocab = config.vocab_size
    other = (SEQ * 8  # the embedding's ids
             + SEQ * h * bf16  # the final norm's input
             + SEQ * h * bf16 + vocab * h * bf16  # the fused loss's grad_hidden, grad_weight
             + 8)  # its count of valid targets
    assert per["other"] == other, per
    held = [f"{s.module} {s.op} {list(s.shape)}" for s in acc.alive_after_backward]
    assert held == [], held


def test_patched_llama_saves_less_than_the_unpatched_one():
    _, patched = _account(patched=True)
    _, eager = _account(patched=False)
    mine, theirs = patched.layer_bytes(), eager.layer_bytes()
    for i in range(LAYERS):  # no fp32 norm copies, no saved silu output
        part = f"layers.{i}"
        assert mine[part] < theirs[part], (part, mine, theirs)
    assert eager.alive_after_backward == []
