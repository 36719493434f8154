"""Cross-entropy on the GPU against a float64 torch reference: loss and gradient for every
reduction, ignore_index, label smoothing, softcap, z-loss, every dtype and the LLM
vocabulary sizes; the one-pass loss-and-gradient op; the in-place gradient; bad targets;
extreme logits; torch.compile."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops import CrossEntropyBwdOp, CrossEntropyFwdOp, CrossEntropyWithGradFwdOp
from tileops.errors import TileOpsError

from ..helpers import assert_close, cluster_configs, poison, poison_allocator, randn

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def reference_rows(x, target, ignore_index=-100, label_smoothing=0.0, softcap=None,
                   lse_square_scale=0.0):
    """Per-row loss in float64 (as torch defines it, plus softcap and z-loss)."""
    z = x.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    if lse_square_scale:
        loss = loss + lse_square_scale * torch.logsumexp(z, -1).square() * (
            target != ignore_index)
    return loss


def reference(x, target, reduction="mean", **params):
    rows = reference_rows(x, target, **params)
    if reduction == "none":
        return rows
    ignore = params.get("ignore_index", -100)
    return rows.sum() / (target != ignore).sum() if reduction == "mean" else rows.sum()


def make_targets(rows, vocab, ignore_every=7, ignore_index=-100):
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[::ignore_every] = ignore_index
    return target


# (rows, vocab, dtype, params)
CASES = [
    (300, 128256, BF16, {}),
    (257, 32000, FP16, {"label_smoothing": 0.1}),
    (64, 256000, BF16, {"softcap": 30.0}),
    (129, 151936, FP32, {"lse_square_scale": 1e-4}),
    (100, 50257, BF16, {"ignore_index": 5, "label_smoothing": 0.05, "softcap": 10.0}),
    (1, 1000, FP16, {}),
    (1000, 129280, BF16, {}),
]


def _ids(cases):
    def params(p):
        return "-".join(f"{k}={v}" for k, v in p.items()) or "defaults"
    return [f"{r}x{v}-{str(d).removeprefix('torch.')}-{params(p)}" for r, v, d, p in cases]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("rows, vocab, dtype, params", CASES, ids=_ids(CASES))
def test_loss_and_gradient_match_float64(rows, vocab, dtype, params, reduction):
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    target = make_targets(rows, vocab, ignore_index=params.get("ignore_index", -100))
    if rows == 1:
        target[0] = 3  # not ignored
    leaf = x.clone().requires_grad_()
    loss = tileops.cross_entropy(leaf, target, reduction=reduction, **params)
    ref_leaf = x.double().requires_grad_()
    ref = reference(ref_leaf, target, reduction, **params)
    assert loss.dtype == dtype and loss.shape == ref.shape
    assert_close(loss, ref, what="loss")
    g = randn(*loss.shape, dtype=dtype) if reduction == "none" else torch.tensor(
        2.5, dtype=dtype, device="cuda")
    loss.backward(g)
    ref.backward(g.double())
    assert leaf.grad.dtype == dtype
    assert_close(leaf.grad, ref_leaf.grad, what="grad")


@pytest.mark.parametrize("rows, vocab, dtype, params", CASES[:4], ids=_ids(CASES[:4]))
def test_inplace_backward_writes_the_gradient_over_the_logits(rows, vocab, dtype, params):
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    target = make_targets(rows, vocab)
    leaf = x.clone().requires_grad_()
    version = leaf._version
    loss = tileops.cross_entropy(leaf, target, inplace_backward=True, **params)
    assert leaf._version > version  # autograd knows the logits are gone
    ref_leaf = x.double().requires_grad_()
    ref = reference(ref_leaf, target, **params)
    assert_close(loss, ref, what="loss")
    (loss * 3).backward()
    (ref * 3).backward()
    assert_close(leaf.grad, ref_leaf.grad, what="grad")


@pytest.mark.parametrize("rows, vocab, dtype, params", CASES, ids=_ids(CASES))
def test_one_pass_loss_and_gradient_op(rows, vocab, dtype, params):
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    target = make_targets(rows, vocab, ignore_index=params.get("ignore_index", -100))
    op = CrossEntropyWithGradFwdOp(**params)
    loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
    grad = poison(torch.empty_like(x))
    op._run("loss_and_grad", x, x, target, poison(loss), poison(lse), grad)
    ref_leaf = x.double().requires_grad_()
    ref = reference_rows(ref_leaf, target, **params)
    ref.sum().backward()
    assert_close(loss, ref, what="loss")
    assert_close(grad, ref_leaf.grad, what="grad")
    z = x.double() if "softcap" not in params else params["softcap"] * torch.tanh(
        x.double() / params["softcap"])
    assert_close(lse, torch.logsumexp(z, -1), what="lse")
    # the functional op form returns the same three
    loss2, lse2, grad2 = op(x, target)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad) and torch.equal(lse2, lse)


# (rows, vocab, dtype, params) for every config of the loss_and_grad space that keeps rows
# in shared memory: vocabularies past and short of a vector multiple (50257 is scalar),
# ignored rows, each optional term; rows past one wave of 132 CTAs, so a CTA reuses its
# shared row for a second row
KEPT_CASES = [
    (300, 128256, BF16, {}),
    (140, 32000, FP16, {"label_smoothing": 0.1}),
    (133, 50257, BF16, {"ignore_index": 5, "lse_square_scale": 1e-4}),
    (140, 151936, BF16, {"softcap": 30.0}),
    (136, 256000, BF16, {"label_smoothing": 0.05, "softcap": 30.0}),
    (135, 128256, FP32, {}),
]


def _name(dtype):
    """'bfloat16' for torch.bfloat16: the kernels' dtype names."""
    return str(dtype).removeprefix("torch.")


def _kernel(mode, vocab, dtype, params):
    from tileops.kernels.softmax.cross_entropy import CrossEntropyKernel
    return CrossEntropyKernel(mode=mode, n=vocab, dtype=_name(dtype),
                              softcap="softcap" in params,
                              smoothing="label_smoothing" in params, dloss_per_row=False)


def _streaming_default(vocab, dtype):
    """The streaming thread map's default (the heuristic's without clusters)."""
    from tileops.kernels.softmax.cross_entropy import CrossEntropyConfig
    from tileops.kernels.softmax.softmax import default_row_config
    row = default_row_config(vocab, _name(dtype), False)
    return CrossEntropyConfig(**dataclasses.asdict(row))


def _kept_configs(vocab, dtype, params):
    """The loss_and_grad space's configs beyond the row kernels' own: rows kept in shared
    memory (with and without prefetch), and the streaming default's prefetch / launch-bound
    variants."""
    from tileops.kernels.softmax.cross_entropy import default_variants, kept_row_configs
    kernel = _kernel("loss_and_grad", vocab, dtype, params)
    default = _streaming_default(vocab, dtype)
    configs = kept_row_configs(vocab, _name(dtype))
    configs += default_variants(default, "loss_and_grad", vocab, _name(dtype))
    assert set(configs) <= set(kernel.config_space("many"))
    kernel.compile_many(configs, "many")  # in parallel; the ops find them compiled
    return configs


def _check_loss_and_grad(config, params, x, target, ref, ref_grad):
    """The one-pass op pinned to `config`, into NaN-poisoned outputs, in place and not: loss
    and gradient against the float64 references; the op form gives the same gradient."""
    rows = x.shape[0]
    op = CrossEntropyWithGradFwdOp(**params)
    op.pin_config(config, x, target)
    loss, lse = poison(torch.empty(rows, device="cuda")), poison(torch.empty(rows,
                                                                     device="cuda"))
    grad = poison(torch.empty_like(x))
    op._run("loss_and_grad", x, x, target, loss, lse, grad)
    assert_close(loss, ref, what=f"loss {config}")
    assert_close(grad, ref_grad, what=f"grad {config}")
    inplace = x.clone()  # the gradient written over the logits
    op._run("loss_and_grad", inplace, inplace, target, loss, lse, inplace)
    assert torch.equal(inplace, grad), config
    out = op(x, target)  # the op form, through the pinned kernel
    assert torch.equal(out[2], grad), config


@pytest.mark.parametrize("rows, vocab, dtype, params", KEPT_CASES, ids=_ids(KEPT_CASES))
def test_every_kept_row_config_matches_float64(rows, vocab, dtype, params):
    """The one-pass op on each config that keeps rows in shared memory between the passes,
    into NaN-poisoned outputs, in place and not: loss, lse and gradient."""
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    target = make_targets(rows, vocab, ignore_index=params.get("ignore_index", -100))
    ref_leaf = x.double().requires_grad_()
    ref = reference_rows(ref_leaf, target, **params)
    ref.sum().backward()
    for config in _kept_configs(vocab, dtype, params):
        _check_loss_and_grad(config, params, x, target, ref, ref_leaf.grad)


@pytest.mark.parametrize("rows, vocab, dtype, params", KEPT_CASES[:4], ids=_ids(KEPT_CASES[:4]))
def test_loss_pass_with_prefetch_matches_float64(rows, vocab, dtype, params):
    """The loss-only pass's prefetch and launch-bound variants of its default."""
    from tileops.kernels.softmax.cross_entropy import default_variants
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    target = make_targets(rows, vocab, ignore_index=params.get("ignore_index", -100))
    ref = reference_rows(x, target, **params)
    z = x.double() if "softcap" not in params else params["softcap"] * torch.tanh(
        x.double() / params["softcap"])
    default = _streaming_default(vocab, dtype)
    for config in default_variants(default, "loss", vocab, _name(dtype)) + [
            dataclasses.replace(default, prefetch=True, ctas_per_sm=1)]:
        op = CrossEntropyFwdOp(**params)
        op.pin_config(config, x, target)
        loss, lse = op(x, target)
        assert_close(loss, ref, what=f"loss {config}")
        assert_close(lse, torch.logsumexp(z, -1), what=f"lse {config}")


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("rows, vocab, dtype, params", KEPT_CASES[:4], ids=_ids(KEPT_CASES[:4]))
def test_gradient_pass_variants_match_float64(rows, vocab, dtype, params, per_row):
    """The gradient pass's prefetch and launch-bound variants of its default, with one
    grad_loss for every row and one per row, into NaN-poisoned outputs."""
    from tileops.kernels.softmax.cross_entropy import CrossEntropyKernel, default_variants
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    target = make_targets(rows, vocab, ignore_index=params.get("ignore_index", -100))
    leaf = x.double().requires_grad_()
    ref = reference_rows(leaf, target, **params)
    grad_loss = randn(rows if per_row else 1, dtype=FP32)
    ref.backward(grad_loss.double().expand(rows))
    lse = CrossEntropyFwdOp(**params)(x, target)[1]
    kernel = CrossEntropyKernel(mode="grad", n=vocab, dtype=_name(dtype),
                                softcap="softcap" in params,
                                smoothing="label_smoothing" in params, dloss_per_row=per_row)
    default = _streaming_default(vocab, dtype)
    # the default (rows past one chunk: unclustered slices) and the streaming variants
    for config in [kernel.heuristic_config("many", "sm_90a"), default,
                   *default_variants(default, "grad", vocab, _name(dtype))]:
        assert config in kernel.config_space("many")
        op = CrossEntropyBwdOp(**params)
        op.pin_config(config, grad_loss, x, target, lse)
        poison_allocator()
        assert_close(op(grad_loss, x, target, lse), leaf.grad, what=f"grad {config}")


def _cluster_configs(mode, vocab, dtype, params):
    """The first cluster config of every (cluster size, CTAs per SM) pair of `mode`'s space
    (cluster_rows.py), compiled in parallel."""
    kernel = _kernel(mode, vocab, dtype, params)
    configs = cluster_configs(kernel)
    kernel.compile_many(configs, "many")
    return configs


@pytest.mark.parametrize("mode", ["loss_and_grad", "loss"])
@pytest.mark.parametrize("rows, vocab, dtype, params", KEPT_CASES, ids=_ids(KEPT_CASES))
def test_every_cluster_config_matches_float64(rows, vocab, dtype, params, mode):
    """Rows split over persistent clusters, a config of every cluster size: the one-pass
    loss and gradient into NaN-poisoned outputs, in place and not, or the loss pass (one
    mode a test: Gemma-2's configs of both took a fresh device's worker past 150 s)."""
    x = randn(rows, vocab, dtype=dtype, std=2.0)
    if "label_smoothing" not in params:  # (smoothing sums every logit: an infinite loss)
        x[3, ::5] = float("-inf")  # masked logits
    target = make_targets(rows, vocab, ignore_index=params.get("ignore_index", -100))
    target[3] = 1
    ref_leaf = x.double().requires_grad_()
    ref = reference_rows(ref_leaf, target, **params)
    ref.sum().backward()
    for config in _cluster_configs(mode, vocab, dtype, params):
        if mode == "loss_and_grad":
            _check_loss_and_grad(config, params, x, target, ref, ref_leaf.grad)
            continue
        op = CrossEntropyFwdOp(**params)
        op.pin_config(config, x, target)
        assert_close(op(x, target)[0], ref, what=f"loss pass {config}")


def test_kept_rows_under_cuda_graph_and_non_contiguous_logits():
    """A kept config captured in a CUDA graph and replayed on new values; a strided input
    (the op makes it contiguous) gives the contiguous one's result."""
    vocab = 128256
    config = next(c for c in _kept_configs(vocab, BF16, {}) if c.kept_chunks and c.prefetch)
    x = randn(200, vocab, dtype=BF16, std=2.0)
    target = make_targets(200, vocab)
    op = CrossEntropyWithGradFwdOp()
    op.pin_config(config, x, target)
    want = op(x, target)
    wide = randn(200, vocab + 64, dtype=BF16)
    wide[:, :vocab] = x
    got = op(wide[:, :vocab], target)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    static_x = x.clone()
    op(static_x, target)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = op(static_x, target)
    static_x.copy_(randn(200, vocab, dtype=BF16, std=2.0))
    graph.replay()
    want = op(static_x.clone(), target)
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))


def test_out_of_range_targets_are_loud():
    x = randn(8, 1000, dtype=BF16)
    target = torch.randint(0, 1000, (8,), device="cuda")
    target[3] = 1000
    with pytest.raises(TileOpsError, match="target.*1000 at position 3"):
        tileops.cross_entropy(x, target, check_target=True)
    rows = tileops.cross_entropy(x, target, reduction="none")
    assert torch.isnan(rows[3]) and torch.isfinite(rows[torch.arange(8, device="cuda") != 3]).all()
    assert torch.isnan(tileops.cross_entropy(x, target))
    target[3] = -5
    with pytest.raises(TileOpsError, match="-5 at position 3"):
        tileops.cross_entropy(x, target, check_target=True)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_extreme_logits_give_numbers_where_torch_does(dtype):
    """Huge logits (1e4), masked (-inf) vocabulary entries and fp16 never give NaN where
    torch gives a number; a row whose target is masked gives inf, as torch."""
    x = randn(6, 32000, dtype=FP32, std=2.0)
    x[0] = (x[0] * 3e3).clamp(-1e4, 1e4)  # huge; the loss (~2e4) still finite in fp16
    x[1, ::2] = -torch.inf
    x[2, 1000:] = -torch.inf
    x = x.to(dtype)
    target = torch.tensor([5, 1, 10, 7, 8, 9], device="cuda")  # row 1: an odd, unmasked id
    target[1] = 1
    leaf = x.clone().requires_grad_()
    got = tileops.cross_entropy(leaf, target, reduction="none")
    want = F.cross_entropy(x.float(), target, reduction="none")
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert_close(got, want.double(), what="loss")
    got.sum().backward()
    assert torch.isfinite(leaf.grad).all()
    target[2] = 2000  # a masked target: the loss is inf for both
    assert torch.isinf(tileops.cross_entropy(x, target, reduction="none")[2])
    assert torch.isinf(F.cross_entropy(x.float(), target, reduction="none")[2])


def test_all_rows_ignored_gives_torch_result():
    x = randn(4, 1000, dtype=BF16)
    target = torch.full((4,), -100, device="cuda")
    assert torch.isnan(tileops.cross_entropy(x, target))  # 0 / 0, as torch
    assert tileops.cross_entropy(x, target, reduction="sum").item() == 0.0


def test_torch_compile_fullgraph():
    def step(x, target):
        return tileops.cross_entropy(x, target, label_smoothing=0.1)

    x = randn(256, 32000, dtype=BF16)
    target = make_targets(256, 32000)
    leaf = x.clone().requires_grad_()
    loss = torch.compile(step, fullgraph=True)(leaf, target)
    loss.backward()
    ref_leaf = x.double().requires_grad_()
    ref = reference(ref_leaf, target, label_smoothing=0.1)
    ref.backward()
    assert_close(loss, ref, what="loss")
    assert_close(leaf.grad, ref_leaf.grad, what="grad")


def test_refuses_what_it_does_not_support():
    x = randn(4, 1000, dtype=BF16)
    target = torch.randint(0, 1000, (4,), device="cuda")
    with pytest.raises(TileOpsError, match="weight"):
        tileops.cross_entropy(x, target, torch.ones(1000, device="cuda"))
    with pytest.raises(TileOpsError, match="reduction"):
        tileops.cross_entropy(x, target, reduction="avg")
    with pytest.raises(TileOpsError, match="target"):
        tileops.cross_entropy(x, target.int())
