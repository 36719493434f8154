"""The softmax family's default configs follow the rule measured on the H200 (2026-12-04,
docs/performance/README.md, twenty-ninth session): on rows longer than one chunk, the
forward two-pass kinds walk their second pass and softmax_bwd meets in slices where the
rows a streaming grid has in flight outgrow the L2; the backward kinds meet in slices for
few rows, and hold rows of up to 8 vectors a thread whole in one CTA where they stay in L2
(thirtieth session); the forward two-pass kinds land 16-bit vocabulary rows' slices by TMA
for many rows (fortieth session, H100), on 256-thread CTAs two an SM with softmax's exps
kept where a row takes several slices (forty-first session, H100); everything else streams."""

import dataclasses

import pytest

from tileops.kernels.softmax import RowConfig, SoftmaxKernel
from tileops.kernels.softmax.softmax import default_row_config, rows_outgrow_l2

STREAM = "stream"
WALK = "walk"  # reverse, with L2 hints on 16-byte vectors
MEET_256 = RowConfig(256, 256, 4, 2, 8, meet=True)
MEET_512 = RowConfig(512, 512, 4, 1, 8, meet=True)
WHOLE_ROW = RowConfig(512, 512, 4, 1, 1)  # a cluster of one: the row in one CTA's registers


def landed(cluster: int) -> RowConfig:  # slices of 512 threads landed by TMA, one CTA an SM
    return RowConfig(512, 512, 4, 1, cluster, landed=True)


def paired(cluster: int, kept: bool) -> RowConfig:  # 256 threads, two CTAs an SM (kept exps)
    return RowConfig(256, 256, 4, 2, cluster, landed=True, kept_exp=kept)



@pytest.mark.parametrize("kind, n, dtype, bucket, want", [
    ("softmax", 128256, "bfloat16", "many", paired(8, True)),  # Llama-3: 1.115x landed(2)
    ("softmax", 128256, "float16", "many", paired(8, True)),
    ("softmax", 151936, "bfloat16", "many", paired(8, True)),  # Qwen3: 1.121x landed(3)
    ("log_softmax", 128256, "bfloat16", "many", paired(8, False)),  # 1.062x landed(4)
    ("log_softmax", 151936, "bfloat16", "many", paired(8, False)),  # Qwen3: 1.071x
    ("log_softmax", 256000, "float16", "many", landed(8)),  # 13 in 5 slices spill
    ("softmax", 256000, "bfloat16", "many", landed(4)),  # Gemma-2: 1.23x; 256 x 2 spill
    ("softmax", 32000, "bfloat16", "many", landed(1)),  # Mistral: a CTA a row
    ("softmax", 128256, "float32", "many", WALK),  # not measured landed: Llama-3 1.10x
    ("softmax", 16384, "bfloat16", "many", STREAM),  # under LANDED_MIN_COLUMNS
    ("softmax", 128256, "bfloat16", "few", STREAM),  # decode 64: walked 0.95x
    ("softmax_bwd", 128256, "bfloat16", "many", MEET_256),  # 1.23x
    ("softmax_bwd", 256000, "bfloat16", "many", MEET_512),  # 8 x 256 spills: 0.28x
    ("softmax_bwd", 32000, "bfloat16", "many", WHOLE_ROW),  # Mistral: 1.28x, meeting 0.74x
    ("log_softmax_bwd", 32000, "float16", "many", WHOLE_ROW),  # 1.08x
    ("softmax_bwd", 32769, "bfloat16", "many", STREAM),  # 9 vectors a thread: not whole
    ("log_softmax_bwd", 12000, "float32", "many", WHOLE_ROW),
    ("log_softmax_bwd", 128256, "bfloat16", "many", STREAM),  # meeting 0.97x
    ("softmax_bwd", 128256, "bfloat16", "few", MEET_256),  # 1.16x at 64 rows
    ("log_softmax_bwd", 128256, "bfloat16", "few", MEET_256),  # 1.12x
    ("softmax_bwd", 128256, "float32", "few", MEET_512),
    ("logsumexp", 128256, "bfloat16", "many", STREAM),  # meeting 0.84x
    ("logsumexp_bwd", 128256, "bfloat16", "few", STREAM),  # one pass: nothing to meet over
    ("softmax", 4096, "bfloat16", "many", STREAM),  # one chunk, read once
    ("softmax_bwd", 8192, "bfloat16", "few", STREAM),
])
def test_defaults_follow_the_measured_rule(kind, n, dtype, bucket, want):
    config = SoftmaxKernel(kind=kind, n=n, dtype=dtype).heuristic_config(bucket, "sm_90a")
    streaming = default_row_config(n, dtype, bucket == "few")
    if want == STREAM:
        assert config == streaming
    elif want == WALK:
        assert config == dataclasses.replace(streaming, reverse=True, l2_hints=True)
    else:
        assert config == want


def test_rows_outgrow_l2_counts_the_inputs():
    """264 streaming CTAs of Mistral's 64 KB rows hold 17 MB (34 MB with the backward's two
    inputs): within the 50 MB L2; Llama-3's 256 KB rows hold 67 MB."""
    many = default_row_config(32000, "bfloat16", False)
    assert not rows_outgrow_l2(32000, "bfloat16", many, 2)
    assert rows_outgrow_l2(128256, "bfloat16", many, 1)
