"""softmax, log_softmax and logsumexp on the GPU (forward and backward) against float64
torch references: every dtype, rows from 1 to 256K columns, odd lengths, masked and
infinite entries, non-contiguous inputs, every element written, torch.compile."""

import pytest
import torch

import tileops
from tileops import (
    LogSoftmaxFwdOp,
    LogsumexpFwdOp,
    SoftmaxBwdOp,
    SoftmaxFwdOp,
)
from tileops.kernels.base import launchers
from tileops.kernels.softmax import RowConfig, SoftmaxKernel

from ..helpers import assert_close, cluster_configs, poison, randn

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FUNCS = {"softmax": (tileops.softmax, torch.softmax),
         "log_softmax": (tileops.log_softmax, torch.log_softmax),
         "logsumexp": (tileops.logsumexp, torch.logsumexp)}
OPS = {"softmax": SoftmaxFwdOp, "log_softmax": LogSoftmaxFwdOp, "logsumexp": LogsumexpFwdOp}
# (shape, dtype): each a thread map of the default configs or a size boundary
SHAPES = [
    ((257, 128256), BF16),    # llama-3 vocab rows: a cluster of 8 CTAs per row
    ((3, 256000), FP16),      # gemma-2 vocab, decode-size batch (few-rows bucket)
    ((1000, 4099), FP32),     # odd length: scalar accesses, a partial chunk
    ((4096, 512), BF16),      # attention-weight rows: a warp per row, 8 rows per CTA
    ((33, 1001), FP16),       # odd short rows, rows not a multiple of the CTA's
    ((2, 5, 2048), BF16),     # leading dims flattened
    ((7, 1), FP32),           # one column
]


def _ids(cases):
    return [f"{'x'.join(map(str, s))}-{str(d).removeprefix('torch.')}" for s, d in cases]


def _reference(name, x, **kw):
    return FUNCS[name][1](x.double(), -1, **kw)


@pytest.mark.parametrize("name", sorted(FUNCS))
@pytest.mark.parametrize("shape, dtype", SHAPES, ids=_ids(SHAPES))
def test_forward_matches_float64(name, shape, dtype):
    x = randn(*shape, dtype=dtype, std=3.0)
    out = FUNCS[name][0](x)
    ref = _reference(name, x)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, what=name)


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_every_output_element_is_written(name):
    """The kernel writes into a NaN-poisoned output: a skipped element stays NaN."""
    x = randn(300, 5000, dtype=BF16)
    op = OPS[name]()
    out = poison(torch.empty(300 if name == "logsumexp" else (300, 5000), dtype=BF16,
                             device="cuda"))
    op._launch(x, x, out)
    assert_close(out, _reference(name, x), what=name)


@pytest.mark.parametrize("name", sorted(FUNCS))
@pytest.mark.parametrize("shape, dtype", [((129, 128256), BF16), ((64, 1000), FP16),
                                          ((5, 3000), FP32)], ids=_ids([((129, 128256), BF16),
                                                                        ((64, 1000), FP16),
                                                                        ((5, 3000), FP32)]))
def test_backward_matches_float64(name, shape, dtype):
    """Autograd's formulas in float64 on the forward's own (rounded) output, which is what
    the backward is given, as torch's: in bf16 the rounding of log_softmax's output alone
    moves exp(output) by up to 3%."""
    x = randn(*shape, dtype=dtype, std=2.0)
    leaf = x.clone().requires_grad_()
    out = FUNCS[name][0](leaf)
    dy = randn(*out.shape, dtype=dtype)
    out.backward(dy)
    y, g = out.detach().double(), dy.double()
    if name == "softmax":
        ref = y * (g - (g * y).sum(-1, keepdim=True))
    elif name == "log_softmax":
        ref = g - y.exp() * g.sum(-1, keepdim=True)
    else:
        ref = g[..., None] * (x.double() - y[..., None]).exp()
    assert leaf.grad.dtype == dtype
    assert_close(leaf.grad, ref, what=f"{name} grad")


def test_keepdim_and_its_gradient():
    x = randn(4, 7, 3000, dtype=BF16)
    leaf = x.clone().requires_grad_()
    out = tileops.logsumexp(leaf, -1, keepdim=True)
    ref = torch.logsumexp(x.double(), -1, keepdim=True)
    assert out.shape == (4, 7, 1)
    assert_close(out, ref)
    out.sum().backward()
    assert_close(leaf.grad, torch.softmax(x.double(), -1), what="grad")


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_non_contiguous_input(name):
    base = randn(64, 2 * 4096, dtype=BF16)
    x = base[:, ::2]  # a strided view: copied contiguous, never read wrong
    assert not x.is_contiguous()
    assert_close(FUNCS[name][0](x), _reference(name, x), what=name)
    t = randn(3000, 64, dtype=FP16).t()  # a transposed view, dim -1 still the rows
    assert_close(FUNCS[name][0](t), _reference(name, t), what=name)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_masked_and_infinite_entries_behave_as_torch(dtype):
    """-inf entries (masked scores) count as exp(-inf) = 0; a fully masked row gives what
    torch gives (NaN for softmax, -inf for logsumexp); +inf gives logsumexp = inf; huge
    logits never overflow. Compared with torch on the same values in float32."""
    x = randn(6, 40000, dtype=FP32, std=2.0)
    x[0, ::3] = -torch.inf            # partly masked
    x[1] = -torch.inf                 # fully masked
    x[2, 17] = torch.inf              # one +inf
    x[3] = x[3] * 1e4                 # huge logits
    x[4, 100:] = -torch.inf           # only a prefix unmasked (most threads see only -inf)
    x[5, :-1] = -torch.inf            # the last element alone
    x = x.to(dtype)
    for name, (ours, ref_fn) in FUNCS.items():
        got = ours(x).float()
        want = ref_fn(x.float(), -1)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        assert torch.equal(torch.isinf(got), torch.isinf(want)), name
        finite = torch.isfinite(want)
        assert_close(got[finite].to(dtype), want[finite], what=name)


def _softmax_bwd_reference(dy, y):
    g, yd = dy.double(), y.double()
    return yd * (g - (g * yd).sum(-1, keepdim=True))


def test_softmax_backward_op_every_element_written():
    y = torch.softmax(randn(100, 7000, dtype=FP32), -1)
    dy = randn(100, 7000, dtype=FP32)
    dx = poison(torch.empty_like(y))
    SoftmaxBwdOp()._launch(y, dy, y, dx)
    assert_close(dx, _softmax_bwd_reference(dy, y))


@pytest.mark.parametrize("config", [RowConfig(256, 32, 1, 1), RowConfig(256, 64, 2, 8),
                                    RowConfig(1024, 1024, 1, 1), RowConfig(512, 128, 4, 4),
                                    RowConfig(1024, 256, 2, 2)],
                         ids=lambda c: f"t{c.threads}-r{c.row_threads}-v{c.vecs}-c{c.ctas_per_sm}")
def test_other_configs_agree(config):
    """Configs the tuner may pick: thread maps other than the defaults' (rows per CTA,
    threads per row, vectors in flight, grid) give the same results."""
    x = randn(777, 33000, dtype=BF16, std=2.0)
    for cls, name in ((SoftmaxFwdOp, "softmax"), (LogsumexpFwdOp, "logsumexp")):
        op = cls()
        op.pin_config(config, x)
        assert_close(op(x), _reference(name, x), what=f"{name} {config}")


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "logsumexp", "softmax_bwd",
                                  "log_softmax_bwd"])
@pytest.mark.parametrize("rows, n, dtype", [(300, 128256, BF16), (77, 50257, FP16),
                                            (65, 151936, FP32)])
def test_every_cluster_config_agrees(kind, rows, n, dtype):
    """Vocabulary rows split over persistent clusters (cluster_rows.py): the default and the
    space's first config of every cluster size and CTAs-per-SM count, into NaN-poisoned
    outputs, against float64; a row with -inf entries and a fully masked row (NaN softmax,
    -inf logsumexp, as torch)."""
    kernel = SoftmaxKernel(kind=kind, n=n, dtype=str(dtype).removeprefix("torch."))
    _check_configs(kernel, kind, cluster_configs(kernel), rows, n, dtype)


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "softmax_bwd", "log_softmax_bwd"])
@pytest.mark.parametrize("rows, n, dtype", [(300, 128256, BF16), (77, 50257, FP16),
                                            (65, 151936, FP32)])
def test_second_pass_walks_agree(kind, rows, n, dtype):
    """The streaming default's second-pass walks (row_map.py: chunks last to first, and with
    L2 eviction hints where vectors are 16 bytes, at one and two CTAs an SM) into
    NaN-poisoned outputs against float64; -inf entries and a fully masked row."""
    from tileops.kernels.softmax.softmax import default_row_config, walk_variants

    dtype_name = str(dtype).removeprefix("torch.")
    kernel = SoftmaxKernel(kind=kind, n=n, dtype=dtype_name)
    configs = walk_variants(default_row_config(n, dtype_name, False), n, dtype_name)
    assert configs and set(configs) <= set(kernel.config_space("many"))
    _check_configs(kernel, kind, configs, rows, n, dtype)


@pytest.mark.parametrize("kind", ["softmax_bwd", "log_softmax_bwd"])
@pytest.mark.parametrize("rows, n, dtype", [(300, 32000, BF16), (257, 20000, FP16),
                                            (260, 12000, FP32)])
def test_whole_row_backward_defaults_agree(kind, rows, n, dtype):
    """The backward kinds' default on rows one CTA holds whole in registers (Mistral's
    32000 columns: a cluster of one, softmax.whole_row_default) against float64."""
    kernel = SoftmaxKernel(kind=kind, n=n, dtype=str(dtype).removeprefix("torch."))
    config = kernel.heuristic_config("many", "sm_90a")
    assert config.cluster == 1 and not config.meet
    _check_configs(kernel, kind, [config], rows, n, dtype)


def _check_configs(kernel, kind, configs, rows, n, dtype):
    """Each config's program into NaN-poisoned outputs against float64: rows of std-3
    values, a row with -inf entries and (forward) a fully masked row."""
    kernel.compile_many(configs, "many")
    x = randn(rows, n, dtype=dtype, std=3.0)
    x[1, ::3] = float("-inf")
    if not kind.endswith("_bwd"):
        x[2] = float("-inf")
    want = _reference(kind.removesuffix("_bwd"), x)
    if kind.endswith("_bwd"):
        y = want.to(dtype)
        dy = randn(rows, n, dtype=dtype)
        yd, dyd = y.double(), dy.double()
        if kind == "softmax_bwd":
            want = yd * (dyd - (dyd * yd).sum(-1, keepdim=True))
        else:
            want = dyd - yd.exp() * dyd.sum(-1, keepdim=True)
    for config in configs:
        compiled = launchers(kernel.compile(config, "many"))
        if kind.endswith("_bwd"):
            out = poison(torch.empty_like(x))
            kernel.run(config, compiled, dy, y, out)
        else:
            out = poison(torch.empty(want.shape, dtype=dtype, device="cuda"))
            kernel.run(config, compiled, x, out)
        assert torch.equal(out.isnan(), want.isnan()), config
        finite = torch.isfinite(want)
        assert torch.equal(torch.isinf(out), torch.isinf(want)), config
        assert_close(out[finite].to(dtype), want[finite], what=f"{kind} {config}")


def test_meeting_defaults_under_cuda_graph_and_growing_scratch():
    """softmax_bwd's default on few vocabulary rows meets in slices through the per-stream
    scratch (workspace.py): captured in a CUDA graph and replayed on new values, then eager
    on more rows than any call before (the partials and the counts grow each on its own)
    and on fewer again, every element of each result checked."""
    op = SoftmaxBwdOp()
    key = dict(kind="softmax_bwd", n=128256, dtype="bfloat16")
    assert SoftmaxKernel(**key).heuristic_config("few", "sm_90a").meet

    def inputs(rows):
        return (randn(rows, 128256, dtype=BF16),
                torch.softmax(randn(rows, 128256, dtype=FP32, std=2.0), -1).to(BF16))

    dy, y = inputs(64)
    op(dy, y)  # load the kernel and size the scratch before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dx = op(dy, y)
    new_dy, new_y = inputs(64)
    dy.copy_(new_dy), y.copy_(new_y)
    graph.replay()
    assert_close(dx, _softmax_bwd_reference(dy, y), what="replayed")
    for rows in (200, 3000, 7):  # few, many (the L2 rule meets too), few again
        dy, y = inputs(rows)
        assert_close(op(dy, y), _softmax_bwd_reference(dy, y), what=f"{rows} rows")


def test_zero_rows():
    x = torch.empty(0, 1000, dtype=BF16, device="cuda")
    assert tileops.softmax(x).shape == (0, 1000)
    assert tileops.logsumexp(x).shape == (0,)


def test_torch_compile_fullgraph_forward_and_backward():
    def fn(x):
        return (tileops.softmax(x) * 2 + tileops.log_softmax(x)).sum() + tileops.logsumexp(x).sum()

    x = randn(64, 32000, dtype=FP32)  # fp32: the reference need not model bf16 rounding
    leaf = x.clone().requires_grad_()
    compiled = torch.compile(fn, fullgraph=True)
    compiled(leaf).backward()
    ref_leaf = x.double().requires_grad_()
    (torch.softmax(ref_leaf, -1) * 2 + torch.log_softmax(ref_leaf, -1)).sum().add(
        torch.logsumexp(ref_leaf, -1).sum()).backward()
    assert_close(leaf.grad, ref_leaf.grad, scale=100.0, what="compiled grad")
