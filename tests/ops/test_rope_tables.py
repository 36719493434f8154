"""RoPE tables (tileops.ops.rope_tables) on the CPU: every scaling against its formula written
out here in float64 per frequency, and against transformers itself when it is importable."""

import math

import pytest
import torch

import tileops
from tileops import TileOpsError

LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
PHI3_SHORT = [1.0 + 0.01 * i for i in range(48)]
PHI3_LONG = [1.5 + 0.1 * i for i in range(48)]


def plain(dim, base):
    return [base ** (-(2 * i) / dim) for i in range(dim // 2)]


def llama3(dim, base, factor, low_freq_factor, high_freq_factor, old):
    out = []
    for f in plain(dim, base):
        wavelen = 2 * math.pi / f
        if wavelen < old / high_freq_factor:
            out.append(f)
        elif wavelen > old / low_freq_factor:
            out.append(f / factor)
        else:
            s = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - s) * f / factor + s * f)
    return out


def yarn(dim, base, factor, original, beta_fast=32, beta_slow=1):
    def boundary(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(boundary(beta_fast)), 0)
    high = min(math.ceil(boundary(beta_slow)), dim - 1)
    out = []
    for i, f in enumerate(plain(dim, base)):
        interpolated = min(max((i - low) / (high - low), 0.0), 1.0)  # 1: divided by factor
        out.append(f / factor * interpolated + f * (1 - interpolated))
    return out


def close(got, want, rtol=2e-6):
    want = torch.tensor(want, dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got.double(), want, rtol=rtol, atol=0), (got, want)


def test_default_and_linear():
    inv, scale = tileops.rope_inv_freq(128, 500000.0)
    close(inv, plain(128, 500000.0))
    assert scale == 1.0
    inv, _ = tileops.rope_inv_freq(64, 10000.0, "linear", factor=4.0)
    close(inv, [f / 4 for f in plain(64, 10000.0)])


def test_dynamic_ntk():
    inv, _ = tileops.rope_inv_freq(64, 10000.0, "dynamic", factor=2.0,
                                   max_position_embeddings=4096)
    close(inv, plain(64, 10000.0))  # within the trained length: unchanged
    inv, _ = tileops.rope_inv_freq(64, 10000.0, "dynamic", factor=2.0,
                                   max_position_embeddings=4096, seq_len=16384)
    base = 10000.0 * (2.0 * 16384 / 4096 - 1.0) ** (64 / 62)
    close(inv, plain(64, base), rtol=1e-5)


def test_llama31():
    inv, scale = tileops.rope_inv_freq(128, 500000.0, "llama3", **LLAMA31)
    close(inv, llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192))
    assert scale == 1.0


@pytest.mark.parametrize("dim, base, factor, original, mscale, want_scale", [
    (128, 1000000.0, 4.0, 32768, None, 0.1 * math.log(4.0) + 1),          # Qwen3 long context
    (64, 10000.0, 40.0, 4096, 1.0, 1.0),                                  # DeepSeek-V3 rope part
])
def test_yarn(dim, base, factor, original, mscale, want_scale):
    extra = dict(mscale=mscale, mscale_all_dim=mscale) if mscale else {}
    inv, scale = tileops.rope_inv_freq(dim, base, "yarn", factor=factor,
                                       original_max_position_embeddings=original, **extra)
    close(inv, yarn(dim, base, factor, original), rtol=1e-5)
    assert scale == pytest.approx(want_scale)


def test_longrope_picks_short_or_long_factors():
    kw = dict(short_factor=PHI3_SHORT, long_factor=PHI3_LONG, max_position_embeddings=131072,
              original_max_position_embeddings=4096)
    inv, scale = tileops.rope_inv_freq(96, 10000.0, "longrope", **kw)
    close(inv, [f / s for f, s in zip(plain(96, 10000.0), PHI3_SHORT, strict=True)], rtol=1e-5)
    assert scale == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    inv, _ = tileops.rope_inv_freq(96, 10000.0, "longrope", seq_len=5000, **kw)
    close(inv, [f / s for f, s in zip(plain(96, 10000.0), PHI3_LONG, strict=True)], rtol=1e-5)


def test_cos_sin_layouts():
    inv, _ = tileops.rope_inv_freq(8, 10000.0)
    positions = torch.tensor([[0, 3, 7]])
    cos, sin = tileops.rope_cos_sin(positions, inv, 2.0, dtype=torch.bfloat16)
    assert cos.shape == (1, 3, 8) and cos.dtype == torch.bfloat16
    angles = [[p * f for f in plain(8, 10000.0)] for p in (0, 3, 7)]
    want = torch.tensor([[2 * math.cos(a) for a in row * 2] for row in angles])
    assert torch.allclose(cos[0].float(), want, atol=1e-2)
    cos, sin = tileops.rope_cos_sin(positions, inv, interleaved=True)
    want = torch.tensor([[math.sin(a) for a in row for _ in (0, 1)] for row in angles])
    assert torch.allclose(sin[0], want, atol=1e-6)
    cache = tileops.rope_cos_sin_cache(inv, 8, dtype=torch.float32)
    assert cache.shape == (8, 8)
    assert torch.allclose(cache[7, :4], torch.tensor([math.cos(a) for a in angles[2]]),
                          atol=1e-6)
    assert torch.allclose(cache[7, 4:], torch.tensor([math.sin(a) for a in angles[2]]),
                          atol=1e-6)


def test_from_config_dict():
    config = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
              "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", **LLAMA31}}
    inv, _ = tileops.rope_inv_freq_from_config(config)
    close(inv, llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192))
    partial = {"hidden_size": 2560, "num_attention_heads": 32, "rope_theta": 10000.0,
               "partial_rotary_factor": 0.4, "max_position_embeddings": 2048}  # Phi-2
    inv, _ = tileops.rope_inv_freq_from_config(partial)
    close(inv, plain(32, 10000.0))


@pytest.mark.parametrize("kwargs, arg", [
    (dict(dim=64, rope_type="ntk-by-parts"), "rope_type"),
    (dict(dim=63), "dim"),
    (dict(dim=64, rope_type="llama3", factor=8.0), "low_freq_factor"),
    (dict(dim=64, rope_type="yarn", factor=4.0), "original_max_position_embeddings"),
])
def test_errors_name_the_argument(kwargs, arg):
    with pytest.raises(TileOpsError, match=f"rope_inv_freq: argument '{arg}'"):
        tileops.rope_inv_freq(**kwargs)


# -- against transformers, where installed ------------------------------------------------
CONFIGS = {
    "llama-2 default": dict(hidden_size=4096, num_attention_heads=32, rope_theta=10000.0),
    "llama-3.1-8b llama3": dict(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                                max_position_embeddings=131072,
                                rope_scaling={"rope_type": "llama3", **LLAMA31}),
    "linear x4": dict(hidden_size=2048, num_attention_heads=16,
                      rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic x2": dict(hidden_size=2048, num_attention_heads=16, max_position_embeddings=4096,
                       rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "qwen3 yarn x4": dict(hidden_size=4096, num_attention_heads=32, head_dim=128,
                          rope_theta=1000000.0, max_position_embeddings=131072,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768}),
    "deepseek-v3 yarn": dict(hidden_size=7168, num_attention_heads=128, head_dim=64,
                             max_position_embeddings=163840,
                             rope_scaling={"rope_type": "yarn", "factor": 40.0,
                                           "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                           "mscale_all_dim": 1.0}),
    "phi-3 longrope": dict(hidden_size=3072, num_attention_heads=32,
                           max_position_embeddings=131072, original_max_position_embeddings=4096,
                           rope_scaling={"rope_type": "longrope", "short_factor": PHI3_SHORT,
                                         "long_factor": PHI3_LONG}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(name):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(**CONFIGS[name])
    module = LlamaRotaryEmbedding(config=config)
    inv, scale = tileops.rope_inv_freq_from_config(config)
    assert torch.equal(inv, module.inv_freq)
    assert scale == module.attention_scaling
    assert torch.equal(tileops.rope_inv_freq_from_config(config.to_dict())[0], inv)
    positions = torch.arange(0, 4000, 3)[None]  # within every config's trained length
    cos, sin = module(torch.zeros(1, dtype=torch.bfloat16), positions)
    got_cos, got_sin = tileops.rope_cos_sin(positions, inv, scale, dtype=torch.bfloat16)
    assert torch.equal(cos, got_cos) and torch.equal(sin, got_sin)
    if name.startswith(("dynamic", "phi-3")):  # the length-dependent types, past the length
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        want, _ = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](
            config, "cpu", seq_len=20000)
        assert torch.equal(tileops.rope_inv_freq_from_config(config, seq_len=20000)[0], want)
