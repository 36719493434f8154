"""Serving attention without a GPU: op-layer errors, meta outputs, torch.compile tracing,
the roofline against a hand count, the split rule, and (marker `compile`) the generated CUDA
of the paged program."""

import math
import random

import pytest
import torch

import tileops
from tileops import (
    ChunkedPrefillAttentionFwdOp,
    DecodeAttentionFwdOp,
    KVCacheAppendFwdOp,
    TileOpsTypeError,
    TileOpsValueError,
)
from tileops.kernels.attention.decode import (
    GATHERED_SPLIT_WAVES,
    LONG_CHUNK,
    MIN_TILES_PER_SPLIT,
    OPEN_RUN,
    ROWS,
    SCHEDULE_THREADS,
    SMS,
    ChunkedPrefillKernel,
    DecodeAttentionKernel,
    DecodeConfig,
    PlannedDecodeKernel,
    block_tiles,
    candidate_count,
    candidate_splits,
    choose_splits,
    combine_program,
    gather_registers,
    key_major_rows,
    key_visible,
    makespan_score,
    schedule_program,
    slot_count,
    slot_tiles,
    split_class,
    split_tiles,
    target_slots,
    tile_visible,
)
from tileops.kernels.attention.mask import INT_OPS

from ..helpers import assert_no_spills_or_serialized_wgmma, meta

BF16 = torch.bfloat16


def paged(batch=4, heads=32, kv_heads=8, head_dim=128, page=16, n_pages=64, max_pages=16,
          seq_q=1):
    return (meta(batch, seq_q, heads, head_dim), meta(n_pages, page, kv_heads, head_dim),
            meta(n_pages, page, kv_heads, head_dim), meta(batch, dtype=torch.int32),
            meta(batch, max_pages, dtype=torch.int32))


@pytest.mark.smoke
@pytest.mark.parametrize("inputs, pattern", [
    (paged(heads=30), r"DecodeAttentionFwdOp: argument 'k_cache': expected shapes "
                      r"satisfying `H % Hkv == 0`"),
    (paged(head_dim=96), r"argument 'q': expected shapes satisfying "
                         r"`D in \(64, 128, 256\)`"),
    (paged(page=24), r"argument 'block_table': expected shapes satisfying "
                     r"`block_table is None or S in \(16, 32, 64, 128, 256\)`"),
    (paged(seq_q=17), r"argument 'q': expected shapes satisfying `1 <= Sq <= 16`"),
    (paged()[:3] + (meta(5, dtype=torch.int32), paged()[4]),
     r"argument 'cache_seqlens': expected shapes satisfying `Bs == B`"),
    (paged()[:4] + (meta(3, 16, dtype=torch.int32),),
     r"argument 'block_table': expected shapes satisfying `block_table is None or "
     r"\(block_table.ndim == 2 and block_table.shape\[0\] == B\)`"),
    (paged()[:4] + (None,), r"argument 'block_table': expected shapes satisfying "
                            r"`block_table is not None or N == B`, got block_table=None, N=64"),
])
def test_bad_shapes_name_the_argument(inputs, pattern):
    with pytest.raises(TileOpsValueError, match=pattern):
        DecodeAttentionFwdOp()(*inputs)


@pytest.mark.smoke
def test_bad_dtypes_and_params():
    q, k, v, lens, table = paged()
    with pytest.raises(TileOpsTypeError, match="argument 'cache_seqlens': expected dtype int32"):
        DecodeAttentionFwdOp()(q, k, v, meta(4, dtype=torch.int64), table)
    with pytest.raises(TileOpsTypeError, match="argument 'k_cache'"):
        DecodeAttentionFwdOp()(q, meta(64, 16, 8, 128, dtype=torch.float16), v, lens, table)
    with pytest.raises(TileOpsValueError, match="argument 'softcap'"):
        DecodeAttentionFwdOp(softcap=-1.0)(q, k, v, lens, table)
    with pytest.raises(TileOpsValueError, match="argument 'window_left'"):
        DecodeAttentionFwdOp(window_left=-2)(q, k, v, lens, table)


@pytest.mark.smoke
def test_meta_outputs_and_functional_shapes():
    q, k, v, lens, table = paged(seq_q=4)
    o, lse = DecodeAttentionFwdOp()(q, k, v, lens, table)
    assert o.shape == (4, 4, 32, 128) and o.dtype == BF16
    assert lse.shape == (4, 32, 4) and lse.dtype == torch.float32
    o, lse = tileops.decode_attention(meta(4, 32, 128), meta(4, 4096, 8, 128),
                                      meta(4, 4096, 8, 128), lens, return_lse=True)
    assert o.shape == (4, 32, 128) and lse.shape == (4, 32)


@pytest.mark.smoke
def test_torch_compile_traces_through_the_custom_ops():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, lens, table, k_new):
        tileops.kv_cache_append(k_new, k_new, k, v, meta(4, dtype=torch.int64))
        return tileops.decode_attention(q * 2, k, v, lens, table, window_left=255) + 1

    q, k, v, lens, table = paged()
    out = step(q[:, 0], k, v, lens, table, meta(4, 8, 128))
    assert out.shape == (4, 32, 128)


@pytest.mark.smoke
def test_a_strided_cache_is_refused_on_meta_and_while_tracing():
    """The launch reads the cache in place and refuses a strided one; meta calls and
    torch.compile's trace say so too (an NHD view of an HND cache is the usual case)."""
    q, k, v, lens, table = paged()
    strided = meta(64, 8, 16, 128).transpose(1, 2)
    with pytest.raises(TileOpsValueError, match="argument 'k_cache': expected a contiguous"):
        DecodeAttentionFwdOp()(q, strided, v, lens, table)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v):
        return tileops.decode_attention(q, k, v, lens, table)

    with pytest.raises(Exception, match="argument 'v_cache': expected a contiguous"):
        step(q[:, 0], k, strided)


@pytest.mark.smoke
def test_roofline_counts_the_rows_each_length_reads():
    q, k, v, _, table = paged(batch=3, page=16, n_pages=64, max_pages=20)
    lens = torch.tensor([1, 100, 300], dtype=torch.int32)  # values on the CPU
    op = DecodeAttentionFwdOp()
    flops, nbytes = op.eval_roofline(q, k, v, lens, table)
    kv = 2 * (1 + 100 + 300) * 8 * 128 * 2
    pages = (1 + 7 + 19) * 4
    assert nbytes == kv + 2 * 3 * 32 * 128 * 2 + 3 * 32 * 4 + 3 * 4 + pages
    assert flops == 4 * 32 * 128 * 401
    windowed = DecodeAttentionFwdOp(window_left=63).eval_roofline(q, k, v, lens, table)[1]
    assert windowed == nbytes - 2 * (300 - 64 + 100 - 64) * 8 * 128 * 2 - (19 - 4 + 7 - 4) * 4


@pytest.mark.smoke
@pytest.mark.parametrize("batch, kv_heads, max_keys, low, high", [
    (1, 8, 131072, SMS, 4 * SMS),  # batch 1 at 128K: (nearly) whole waves of CTAs
    (8, 8, 32768, SMS, 4 * SMS),
    (64, 8, 4096, 1, 1),  # 512 CTAs already: no split
    (256, 8, 1024, 1, 1),
    (1, 8, 256, 1, 8),  # two tiles: few splits however empty the GPU
])
def test_split_rule_fills_the_gpu(batch, kv_heads, max_keys, low, high):
    splits = choose_splits(batch, kv_heads, 1, max_keys, 128)
    if low == high == 1:
        assert splits == 1
    elif high <= 8:
        assert splits <= 1
    else:
        assert low * 0.9 <= batch * kv_heads * splits <= high


@pytest.mark.smoke
@pytest.mark.parametrize("n_q, group, window_left, causal", [
    (1, 4, -1, True), (4, 8, -1, True), (4, 8, -1, False), (1, 1, 0, True), (3, 2, 5, True),
    (2, 8, 130, False), (200, 8, -1, True), (37, 4, 100, True), (130, 1, -1, False),
])
@pytest.mark.parametrize("block_n", [64, 128])
def test_splits_cover_every_visible_key_once(n_q, group, window_left, causal, block_n):
    """The kernel's integer formulas on the CPU, per 64-row block of a request's
    (token, head) rows: the splits' tiles are disjoint and cover every key the block's
    tokens see; a tile called fully visible is, for every token of the block."""
    rows = n_q * group
    for seqlen in sorted({n_q, n_q + 1, 63, 64, 65, 129, 300, 1000} - set(range(n_q))):
        for row0 in range(0, rows, ROWS):
            tokens = range(row0 // group, (min(row0 + ROWS, rows) - 1) // group + 1)
            position = [seqlen - n_q + t for t in tokens]
            want = {j for pos in position for j in range(seqlen)
                    if key_visible(pos, j, seqlen, window_left, causal)}
            first, n_tiles = block_tiles(position[0], position[-1], seqlen, block_n,
                                         window_left, causal, INT_OPS)
            for n_splits in (1, 2, 3, 7, 16):
                walked = []
                for split in range(n_splits):
                    begin, mine = split_tiles(first, n_tiles, split, n_splits, INT_OPS)
                    walked += range(begin, begin + mine)
                assert len(walked) == len(set(walked)), (seqlen, row0, n_splits)
                covered = {j for t in walked for j in range(t * block_n, (t + 1) * block_n)}
                assert want <= covered, (seqlen, row0, n_splits)
                assert all(0 <= t < -(-seqlen // block_n) for t in walked)
            padded_last = seqlen - n_q + (row0 + ROWS - 1) // group  # as the kernel's mask
            for tile in range(first, first + n_tiles):
                if tile_visible(tile * block_n, position[0], padded_last, seqlen, block_n,
                                window_left, causal):
                    assert all(key_visible(pos, j, seqlen, window_left, causal)
                               for pos in position
                               for j in range(tile * block_n, (tile + 1) * block_n))


@pytest.mark.smoke
def test_kv_cache_append_checks():
    k_new, pages = meta(4, 8, 128), meta(64, 16, 8, 128)
    k_out, v_out = KVCacheAppendFwdOp()(k_new, k_new, pages, pages,
                                        meta(4, dtype=torch.int64))
    assert k_out.shape == pages.shape
    with pytest.raises(TileOpsValueError, match="argument 'slot_mapping'"):
        KVCacheAppendFwdOp()(k_new, k_new, pages, pages, meta(5, dtype=torch.int64))
    with pytest.raises(TileOpsValueError, match="argument 'k_pages'"):
        KVCacheAppendFwdOp()(k_new, k_new, meta(64, 16, 4, 128), pages,
                             meta(4, dtype=torch.int64))


@pytest.mark.compile
@pytest.mark.full
def test_paged_program_uses_tma_and_wgmma_without_spills(tmp_path):
    """Pages of 16 keys in the TMA configs of the space (the default gathers them): sixteen
    page copies per 128-key tile, still by TMA, warp-specialized; ptxas: no spills, no
    serialized wgmma."""
    kernel = DecodeAttentionKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128,
                                   q_len=1, page_size=16, window_left=-1, softcap=0.0,
                                   causal=True)
    config = DecodeConfig(128, 2, hoist_pages=True)
    assert config in kernel.config_space("split")
    compiled = kernel.compile(config, "split")
    source = compiled[0].get_kernel_source()
    assert "tma_load" in source and "wgmma" in source, source
    assert "warpgroup_reg_alloc" in source  # a producer warpgroup feeds the consumers
    assert_no_spills_or_serialized_wgmma(compiled[0], tmp_path)


class _HostMath:
    """A compiled kernel whose source spells infinity the host's way (the emulator compiles
    the kernel body without CUDA's math_constants.h)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def get_kernel_source(self):
        return self.compiled.get_kernel_source().replace("CUDART_INF_F", "INFINITY")

    def get_host_source(self):
        return self.compiled.get_host_source()


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_combine_program_on_the_cpu(dtype):
    """The split combine, run thread by thread on the CPU (tests/cuda_emulation.py): empty
    splits (-inf) weigh nothing, a request whose splits are all empty gets 0 and -inf, and
    the merge equals softmax-weighting the splits by their lse."""
    from ..cuda_emulation import run

    kernel = DecodeAttentionKernel(dtype=dtype, heads=4, kv_heads=2, head_dim=128, q_len=2,
                                   page_size=16, window_left=-1, softcap=0.0, causal=True)
    compiled = kernel.compile(kernel.heuristic_config("split", "sm_90a"), "split")[1]
    batch, splits = 3, 5
    torch.manual_seed(0)
    o_part = torch.randn(batch, 2, 4, splits, 128)
    lse_part = torch.randn(batch, 2, 4, splits) * 4
    lse_part[0, :, :, 1:3] = -math.inf  # empty splits
    lse_part[2] = -math.inf  # an empty request
    o_part[2] = 0.0
    o = torch.full((batch, 2, 4, 128), math.nan).to(getattr(torch, dtype))
    lse = torch.full((batch, 4, 2), math.nan)
    run(_HostMath(compiled), batch * 2 * 4, 64,
        dict(o_part=o_part, lse_part=lse_part, o=o, lse=lse),
        dict(batch=batch, n_splits=splits))
    want_lse = torch.logsumexp(lse_part, dim=-1)  # [B, Sq, H]
    weights = torch.exp(lse_part - want_lse[..., None]).nan_to_num(0.0)
    want_o = (weights[..., None] * o_part).sum(-2)
    torch.testing.assert_close(o.float(), want_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse.transpose(1, 2))
    assert torch.equal(o[2].float(), torch.zeros(2, 4, 128))


@pytest.mark.compile
def test_heads_first_append_program_on_the_cpu():
    """kv_layout "HND": pools [N, Hkv, page, D] seen as [N * Hkv, page, D] blocks; a token's
    head h lands in block page * Hkv + h at its offset, slot -1 and slots past the pool
    skipped, the other rows untouched."""
    from tileops.kernels.attention.kv_cache import KVCacheAppendKernel

    from ..cuda_emulation import run

    kv_heads, head_dim, page, n_pages, tokens = 4, 64, 16, 5, 11
    kernel = KVCacheAppendKernel(dtype="bfloat16", slot_dtype="int64", width=kv_heads * head_dim,
                                 head_dim=head_dim, page_size=page)
    config = kernel.heuristic_config("all", "sm_90a")
    compiled = kernel.compile(config, "all")[0]
    k_new = torch.randn(tokens, kv_heads, head_dim).to(BF16)
    v_new = torch.randn(tokens, kv_heads, head_dim).to(BF16)
    k_pages = torch.randn(n_pages, kv_heads, page, head_dim).to(BF16)
    v_pages = torch.randn(n_pages, kv_heads, page, head_dim).to(BF16)
    slots = torch.randperm(n_pages * page)[:tokens]
    slots[3], slots[7] = -1, n_pages * page + 5
    k_want, v_want = k_pages.clone(), v_pages.clone()
    keep = (slots >= 0) & (slots < n_pages * page)
    for want, new in ((k_want, k_new), (v_want, v_new)):
        want.transpose(1, 2)[slots[keep] // page, slots[keep] % page] = new[keep]
    run(compiled, -(-tokens // config.block_rows), config.threads,
        dict(k_new=k_new.reshape(tokens, -1), v_new=v_new.reshape(tokens, -1),
             k_pages=k_pages.view(-1, page, head_dim), v_pages=v_pages.view(-1, page, head_dim),
             slot_mapping=slots),
        dict(tokens=tokens, slots=n_pages * kv_heads))
    assert torch.equal(k_pages, k_want) and torch.equal(v_pages, v_want)


@pytest.mark.compile
@pytest.mark.smoke
def test_kv_cache_append_program_on_the_cpu():
    """The append kernel run thread by thread on the CPU: rows land at their slots, slot -1
    and slots past the pool are skipped, every other row is untouched."""
    from tileops.kernels.attention.kv_cache import KVCacheAppendKernel

    from ..cuda_emulation import run

    kernel = KVCacheAppendKernel(dtype="bfloat16", slot_dtype="int64", width=1024)
    config = kernel.heuristic_config("all", "sm_90a")
    compiled = kernel.compile(config, "all")[0]
    tokens, n_slots = 11, 64
    k_new, v_new = torch.randn(tokens, 1024).to(BF16), torch.randn(tokens, 1024).to(BF16)
    k_pages, v_pages = torch.randn(n_slots, 1024).to(BF16), torch.randn(n_slots, 1024).to(BF16)
    slots = torch.randperm(n_slots)[:tokens]
    slots[3], slots[7] = -1, n_slots + 5
    k_want, v_want = k_pages.clone(), v_pages.clone()
    keep = (slots >= 0) & (slots < n_slots)
    k_want[slots[keep]], v_want[slots[keep]] = k_new[keep], v_new[keep]
    run(compiled, -(-tokens // config.block_rows), config.threads,
        dict(k_new=k_new, v_new=v_new, k_pages=k_pages, v_pages=v_pages, slot_mapping=slots),
        dict(tokens=tokens, slots=n_slots))
    assert torch.equal(k_pages, k_want) and torch.equal(v_pages, v_want)


def e4m3_ties_and_edges(dtype):
    """Inputs x (in `dtype`) whose quotients by a scale of 2^-7 (x * 2^7, exact) land where
    a rounding slip would show: every e4m3 value, every midpoint between neighbours (ties,
    which go to the even code), the subnormal range, the saturation edge (448, 464 = the
    midpoint to the NaN code, beyond), and the neighbours of each in `dtype`."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    edges = torch.tensor([452.0, 456.0, 460.0, 464.0, 472.0, 480.0, 2.0 ** 13, 2.0 ** -10,
                          2.0 ** -11])
    x = torch.cat([grid, mids, edges]) * 2.0 ** -7
    assert torch.equal(x.to(dtype).float(), x)  # at most 7 significant bits: exact
    bits = x.to(dtype).view(torch.int16)
    x = torch.cat([bits, bits + 1, (bits - 1).clamp(min=0)]).view(dtype)
    return torch.cat([x, -x])


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16,
                                   pytest.param(BF16, marks=pytest.mark.full)])
def test_fp8_append_program_rounds_like_torch(dtype):
    """The fp8 append kernel's generated code, run on the CPU, stores exactly torch's
    (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn), bit for bit: IEEE division
    (no fast math) and a round-to-nearest-even, saturating conversion
    (cvt.rn.satfinite), over the GPU test's data (randn, scales in [0.002, 0.022], per
    tensor and per head) and over quotients at every e4m3 tie and edge (x = q * 2^-7 with
    a scale of 2^-7: exact in fp16 and bf16). The GPU tests compare with equality."""
    from tileops.kernels.attention.kv_cache import KVCacheAppendKernel

    from ..cuda_emulation import run

    kv_heads, head_dim = 4, 128
    width = kv_heads * head_dim
    kernel = KVCacheAppendKernel(dtype=str(dtype).removeprefix("torch."), slot_dtype="int64",
                                 width=width, cache_dtype="float8_e4m3fn", head_dim=head_dim)
    config = kernel.heuristic_config("all", "sm_90a")
    compiled = kernel.compile(config, "all")[0]
    gen = torch.Generator().manual_seed(0)
    tokens = 1024
    x = torch.randn(2, tokens, width, generator=gen)
    x = x.to(dtype)
    edges = e4m3_ties_and_edges(dtype)
    rows = -(-edges.numel() // head_dim)
    block = torch.zeros(rows * head_dim, dtype=dtype)
    block[:edges.numel()] = edges
    x[1, :rows, :head_dim] = block.view(rows, head_dim)  # v, head 0: scale 2^-7
    for n_scale in (kv_heads, 1):
        scales = torch.rand(2, n_scale, generator=gen) * 0.02 + 0.002
        scales[1, 0] = 2.0 ** -7
        pools = torch.full((2, tokens, width), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        run(compiled, -(-tokens // config.block_rows), config.threads,
            dict(k_new=x[0], v_new=x[1], k_pages=pools[0], v_pages=pools[1],
                 slot_mapping=torch.arange(tokens), k_scale=scales[0], v_scale=scales[1]),
            dict(tokens=tokens, slots=tokens, n_scale=n_scale))
        for i in range(2):
            heads = x[i].float().view(tokens, kv_heads, head_dim)
            want = (heads / scales[i].view(1, -1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
            got = pools[i].view(torch.uint8).view(tokens, kv_heads, head_dim)
            bad = got != want.view(torch.uint8)
            assert not bad.any(), (
                f"{'kv'[i]}, {n_scale} scales: {int(bad.sum())} elements differ, e.g. inputs "
                f"{heads[bad][:4].tolist()} -> codes {got[bad][:4].tolist()}, torch's "
                f"{want.view(torch.uint8)[bad][:4].tolist()}")


class _Recorder:
    """Stands in for a Kernel: records the runtime size and the tensors of each launch."""

    def __init__(self, log, key):
        self.log, self.key = log, key

    def __call__(self, size, *tensors):
        self.log.append((self.key, size, tensors))


def _recording(op, monkeypatch, names=None):
    log = []

    def get_kernel(dispatch, device, **key):
        if names is not None:
            names.append(dispatch)
        return _Recorder(log, key)

    monkeypatch.setattr(op, "get_kernel", get_kernel)
    return log


@pytest.mark.smoke
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("paged", [True, False])
def test_launch_arguments(paged, kv_layout, monkeypatch):
    """What `forward` hands the kernel (CPU tensors, a recording kernel), the first slice's
    path (`planned` off): the split count from shapes alone, fp32 partials of that many
    splits, the placeholder table for a contiguous cache, the default scale and the program
    key (kv_layout in it only when heads-first: the NHD programs keep their keys)."""
    op = DecodeAttentionFwdOp(window_left=255, kv_layout=kv_layout)
    monkeypatch.setattr(op, "planned", False)
    log = _recording(op, monkeypatch)
    q = torch.randn(2, 1, 8, 128).to(BF16)
    rows, outer = (16, 600) if paged else (4800, 2)
    shape = (outer, 2, rows, 128) if kv_layout == "HND" else (outer, rows, 2, 128)
    k = v = torch.randn(shape).to(BF16)
    table = torch.randint(0, 600, (2, 300), dtype=torch.int32) if paged else None
    lens = torch.tensor([5, 4800], dtype=torch.int32)
    o, lse = op.forward(q, k, v, lens, table)
    (key, splits, args), = log
    assert key == {"dtype": "bfloat16", "heads": 8, "kv_heads": 2, "head_dim": 128, "q_len": 1,
                   "page_size": 16 if paged else 0, "window_left": 255, "softcap": 0.0,
                   "causal": True, **({"kv_layout": "HND"} if kv_layout == "HND" else {})}
    assert splits == choose_splits(2, 2, 1, 4800, 128) > 1
    assert op.kernels_for(op.check((q, k, v, lens, table))) == [  # what the sweep builds
        ("decode_attention", key, splits)]
    (q_arg, k_arg, _, table_arg, lens_arg, cu_arg, k_scale, v_scale, o_arg, lse_arg, o_part,
     lse_part, blocks, scale) = args
    # placeholders the programs never read: views of the call's own tensors, none kept
    # across calls (CUDA-graph trees refuse a tensor born in their pool and kept alive)
    assert k_scale.dim() == 1 and k_scale.dtype == torch.float32
    assert k_scale.data_ptr() == v_scale.data_ptr() == lse.data_ptr()
    assert cu_arg is lens  # its length is symbolic
    if not paged:
        assert table_arg.shape == (1, 1) and table_arg.data_ptr() == lens.data_ptr()
    assert k_arg is k and o_arg is o and lse_arg is lse and lens_arg is lens
    assert table_arg.shape == ((2, 300) if paged else (1, 1))
    assert blocks == 1
    assert o_part.shape == (2, 1, 8, splits, 128) and o_part.dtype == torch.float32
    assert lse_part.shape == (2, 1, 8, splits) and lse.shape == (2, 8, 1)
    assert scale == pytest.approx(128 ** -0.5)


@pytest.mark.smoke
@pytest.mark.parametrize("seq_q, heads", [(1, 8), (4, 32)])
def test_planned_launch_arguments(seq_q, heads, monkeypatch):
    """The default (planned) path: the schedule runs with the call, the work buffers are
    sized for the batch plus one wave of splits (SMs / (KV heads x row blocks)), and the
    sweep builds the planned kernel."""
    op = DecodeAttentionFwdOp()
    monkeypatch.setattr(op, "planned", True)
    log = _recording(op, monkeypatch)
    q = torch.randn(3, seq_q, heads, 128).to(BF16)
    k = v = torch.randn(600, 16, 2, 128).to(BF16)
    table = torch.randint(0, 600, (3, 300), dtype=torch.int32)
    lens = torch.tensor([5, 4800, 17], dtype=torch.int32)
    o, lse = op.forward(q, k, v, lens, table)
    (key, size, args), = log
    assert key["q_len"] == seq_q and size == 0
    assert op.kernels_for(op.check((q, k, v, lens, table))) == [
        ("decode_attention_planned", key, 0)]
    (schedule, q_arg, k_arg, _, table_arg, lens_arg, slot_table, split_ends, _, _, o_arg,
     lse_arg, o_part, lse_part, blocks, target, scale) = args
    assert schedule is True and k_arg is k and table_arg is table and lens_arg is lens
    assert o_arg is o and lse_arg is lse
    # the tuner compares all but the work buffers (configs of other tiles schedule others)
    assert PlannedDecodeKernel.workspace_args == {i for i, t in enumerate(args) if any(
        t is w for w in (slot_table, split_ends, o_part, lse_part))}
    assert blocks == -(-heads // 2 * seq_q // ROWS) and target == target_slots(2, blocks, SMS)
    slots = 3 + GATHERED_SPLIT_WAVES * target  # room for a gathered program's waves
    assert slot_table.shape == (slots, 4) and split_ends.shape == (3,)
    assert slot_table.dtype == split_ends.dtype == torch.int32
    assert o_part.shape == (slots, seq_q, heads, 128) and lse_part.shape == (slots, seq_q, heads)
    assert o_part.is_contiguous() and lse_part.is_contiguous()
    assert o_part.data_ptr() % 16 == 0 and lse_part.data_ptr() % 16 == 0


def schedule_model(lengths, q_len, block_n, window_left, causal, target, n_slots,
                   fit_waves=0):
    """(slot_table, split_ends) as the schedule program must write them."""
    tiles = [block_tiles(n - q_len, n - 1, n, block_n, window_left, causal, INT_OPS)
             for n in lengths]
    total = sum(t for _, t in tiles)
    table = [[-1, 0, 0, 0] for _ in range(n_slots)]
    rule = pick_rule([t for _, t in tiles], target, n_slots, fit_waves)
    up = [candidate_count(t, total, target, rule, INT_OPS) for _, t in tiles]
    target *= max(rule, 1)  # the size classes: relative to the chosen rule's target
    requests = []  # (size class, request, first tile, tiles, splits, tiles per split)
    for b, (first, t) in enumerate(tiles):
        count = up[b]
        per = -(-t // count)
        requests.append((split_class(per, target, total, INT_OPS), b, first, count, per))
    ends, slot = [0] * len(lengths), 0
    for _, b, first, count, per in sorted(requests):  # longest splits first, then b
        for i in range(count):
            start = 0 if i == 0 else first + i * per
            run = OPEN_RUN if i == count - 1 else first + (i + 1) * per - start
            if slot + i < n_slots:
                table[slot + i] = [b, start, run, count]
        slot += count
        ends[b] = slot
    return table, ends


def pick_rule(tiles, wave, n_slots, fit_waves):
    """The candidate rule a `fit_waves` schedule takes: the lowest makespan estimate among
    those whose slots fit n_slots, ties to the lower rule (0 where fit_waves is 0)."""
    total, best = sum(tiles), (None, 0)
    for k in range(fit_waves + 1):
        counts, pers, longs = zip(*(candidate_splits(t, total, wave, k, INT_OPS)
                                    for t in tiles), strict=True)
        score = makespan_score(sum(longs), max(pers), total, wave, INT_OPS)
        if sum(counts) <= n_slots and (best[0] is None or score < best[0]):
            best = (score, k)
    return best[1]


SCHEDULES = {  # name -> (lengths, q_len, kv_heads, window_left)
    "one long request among many short": ([700] * 63 + [131072], 1, 8, -1),
    "batch 1 at 128k": ([131072], 1, 8, -1),
    "uniform 8 x 32k": ([32768] * 8, 1, 8, -1),
    "mixed with empties": ([0, 1, 129, 5000, 0, 40000, 3], 4, 2, -1),
    "window": ([100, 20000, 9000], 1, 8, 4095),
    "more requests than threads": ([(97 * i) % 3000 for i in range(SCHEDULE_THREADS + 77)],
                                   1, 8, -1),
}


@pytest.mark.smoke
@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_balances_and_bounds_the_slots(name):
    """The schedule's arithmetic: at most one wave of splits plus one per request, a long
    request splits however full the batch, no split longer than a target's share of the
    keys, the slots laid out longest split first, every request's runs partition its
    tiles."""
    lengths, q_len, kv_heads, window_left = SCHEDULES[name]
    target = target_slots(kv_heads, 1)
    n_slots = slot_count(len(lengths), kv_heads, 1)
    table, ends = schedule_model(lengths, q_len, 128, window_left, True, target, n_slots)
    assert max(ends) <= n_slots
    tiles = [block_tiles(n - q_len, n - 1, n, 128, window_left, True, INT_OPS)[1]
             for n in lengths]
    share = -(-sum(tiles) // target)
    sizes = [-(-tiles[b] // count) for b, _, _, count in table if b >= 0]
    assert all(size <= max(share, MIN_TILES_PER_SPLIT) for size in sizes)
    classes = [split_class(size, target, sum(tiles), INT_OPS) for size in sizes]
    assert classes == sorted(classes)
    for b, n in enumerate(lengths):
        runs = [row for row in table if row[0] == b]
        assert all(row[3] == len(runs) for row in runs)
        # the runs cut to the request's tiles when it runs: every tile once, for the
        # lengths scheduled and for lengths grown or shrunk since (a stale schedule)
        for now in (n, n + 1, n + 129, 3 * n + 1000, n // 2, 0):
            first, t = block_tiles(now - q_len, now - 1, now, 128, window_left, True, INT_OPS)
            walked = []
            for _, start, tiles, _ in runs:
                begin, mine = slot_tiles(first, t, start, tiles, INT_OPS)
                walked += range(begin, begin + mine)
            assert walked == list(range(first, first + t)), (b, n, now)
        if len(runs) > 1:  # balanced for the scheduled lengths
            first, t = block_tiles(n - q_len, n - 1, n, 128, window_left, True, INT_OPS)
            sizes = [slot_tiles(first, t, start, tiles, INT_OPS)[1]
                     for _, start, tiles, _ in runs]
            assert max(sizes) <= -(-t // len(runs)), (b, sizes)
    if name == "one long request among many short":
        long_runs = [row for row in table if row[0] == 63]
        assert len(long_runs) >= 8  # split, though 64 x 8 CTAs already fill 132 SMs
    if name == "batch 1 at 128k":
        assert len(table) - [row[0] for row in table].count(-1) == target == SMS // 8


@pytest.mark.smoke
@pytest.mark.parametrize("n_q, group, window_left", [(1, 4, -1), (4, 8, -1), (16, 8, 100),
                                                     (3, 2, 5), (8, 16, -1)])
def test_slot_runs_cover_every_row_block_once(n_q, group, window_left):
    """A planned slot's run of the request's tiles (the first from tile 0, the last
    open-ended), cut to a row block's visible tiles (`slot_tiles`): over the request's
    slots every tile a block sees is walked once."""
    rows = n_q * group
    for seqlen in (n_q, 64, 65, 300, 1000, 5000):
        rfirst, rtiles = block_tiles(seqlen - n_q, seqlen - 1, seqlen, 128, window_left, True,
                                     INT_OPS)
        for count in (1, 2, 3, 7):
            per = -(-rtiles // count)
            starts = [0] + [rfirst + i * per for i in range(1, count)]
            lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)] + [OPEN_RUN]
            for row0 in range(0, rows, ROWS):
                last = min(row0 + ROWS, rows) - 1
                first, n_tiles = block_tiles(seqlen - n_q + row0 // group,
                                             seqlen - n_q + last // group, seqlen, 128,
                                             window_left, True, INT_OPS)
                walked = []
                for start, tiles in zip(starts, lengths, strict=True):
                    b, mine = slot_tiles(first, n_tiles, start, tiles, INT_OPS)
                    walked += range(b, b + mine)
                assert walked == list(range(first, first + n_tiles)), (seqlen, count, row0)


def _planned_kernel(q_len=1, heads=8, kv_heads=2, window_left=-1):
    return PlannedDecodeKernel(dtype="bfloat16", heads=heads, kv_heads=kv_heads,
                               head_dim=128, q_len=q_len, page_size=16,
                               window_left=window_left, softcap=0.0, causal=True)


def _planned_program(index, q_len=1, heads=8, kv_heads=2, window_left=-1, config=None):
    """Program `index` of the planned kernel (0 schedule, 1 attention, 2 combine) in
    `config` (default: the kernel's), compiled alone (the attention takes ~25 s on two
    cores; the CPU tests need only the others)."""
    import tilelang

    kernel = _planned_kernel(q_len, heads, kv_heads, window_left)
    config = config or kernel.heuristic_config("planned", "sm_90a")
    program = kernel.program(config, "planned")[index]
    return tilelang.compile(program, target=kernel.target)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["one long request among many short", "mixed with empties",
                                  "window", "more requests than threads"])
def test_schedule_program_on_the_cpu(name):
    """The schedule kernel run on the CPU with its threads concurrent (shuffles, barriers,
    tests/cuda_emulation_threads.py) writes exactly the model's slot table and ends, -1 rows
    past the last slot (NaN-like junk in every buffer first)."""
    from ..cuda_emulation_threads import run

    lengths, q_len, kv_heads, window_left = SCHEDULES[name]
    compiled = _planned_program(0, q_len, 8, kv_heads, window_left)
    target = target_slots(kv_heads, 1)
    n_slots = slot_count(len(lengths), kv_heads, 1)
    lens = torch.tensor(lengths, dtype=torch.int32)
    slot_table = torch.full((n_slots, 4), -77, dtype=torch.int32)
    split_ends = torch.full((len(lengths),), -77, dtype=torch.int32)
    run(compiled, 1, SCHEDULE_THREADS,
        dict(cache_seqlens=lens, slot_table=slot_table, split_ends=split_ends),
        dict(batch=len(lengths), n_slots=n_slots, target_slots=target))
    block_n = _planned_kernel(q_len, 8, kv_heads, window_left).heuristic_config(
        "planned", "sm_90a").block_n  # the tile the schedule counts in (64 at page 16)
    table, ends = schedule_model(lengths, q_len, block_n, window_left, True, target, n_slots)
    assert split_ends.tolist() == ends
    assert slot_table.tolist() == table


# lengths for the fitted schedule: DeepSeek-V3 MLA rows in the seesaw's 128-key pairs, one
# wave of 66 slots (132 SMs, two 64-head CTAs a slot)
FIT = {
    "32 x 4k": [4096] * 32,
    "32 x 32k": [32768] * 32,
    "80 x 8k": [8192] * 80,
    "128 x 8k": [8192] * 128,
    "mixed 512-32k": [512, 1024, 2048, 4096, 8192, 16384, 32768, 3000] * 8,
    "1 x 32k": [32768],
    "24 x 8k and 2 x 1k": [8192] * 24 + [1024] * 2,
    "more requests than threads": [(97 * i) % 30000 for i in range(SCHEDULE_THREADS + 77)],
}
WAVE, FIT_WAVES, PAIR = SMS // 2, 4, 128


def fitted(lengths, fit_waves=FIT_WAVES, n_slots=None):
    n_slots = n_slots or len(lengths) + FIT_WAVES * WAVE
    return schedule_model(lengths, 1, PAIR, -1, True, WAVE, n_slots, fit_waves)[0]


def simulated_makespan(table, lengths, split_cost=1):
    """The slots dealt in order to WAVE lanes, each to the lane free first (the CTAs start
    in slot order), a slot taking its tiles plus split_cost."""
    lanes = [0] * WAVE
    for b, start, run, _ in table:
        if b >= 0:
            t = -(-lengths[b] // PAIR)
            tiles = max(min(start + run, t) - start, 0)
            lanes[lanes.index(min(lanes))] += tiles + split_cost
    return max(lanes)


def rule_of(lengths, fit_waves=FIT_WAVES, n_slots=None):
    tiles = [-(-n // PAIR) for n in lengths]
    return pick_rule(tiles, WAVE, n_slots or len(lengths) + FIT_WAVES * WAVE, fit_waves)


@pytest.mark.smoke
def test_fitted_schedule_picks_the_rule_that_saves_waves():
    """Rounding up alone: 32 equal requests at a share of 2.06 slots take 3 (96 slots, a
    second wave 45% full) where 2 fit one wave; 80 requests of 8K one slot each (66 in one
    wave, 14 in a second as long) where 4 waves of quarter splits take 0.65x the time.
    Mixed lengths, batch 1 and 128 x 8K keep the rule; without fit_waves nothing changes;
    a rule whose slots do not fit the buffers is never taken."""
    assert rule_of(FIT["32 x 4k"]) == rule_of(FIT["32 x 32k"]) == 1
    assert used_slots(fitted(FIT["32 x 4k"])) == 64
    assert rule_of(FIT["80 x 8k"]) == 4 and used_slots(fitted(FIT["80 x 8k"])) == 320
    # a short or empty request among them changes nothing; nor does an empty one fit
    # batch 1 (whose one request already spreads over the wave)
    assert rule_of(FIT["80 x 8k"] + [0]) == rule_of(FIT["80 x 8k"] + [1]) == 4
    assert rule_of([32768, 0]) == 0
    for name in ("mixed 512-32k", "1 x 32k", "128 x 8k"):
        assert rule_of(FIT[name]) == 0, name
    for lengths in FIT.values():
        assert used(fitted(lengths, 0)) == used(fitted(lengths, 0, len(lengths) + WAVE))
        assert rule_of(lengths, 0) == 0
        assert used_slots(fitted(lengths, n_slots=len(lengths) + WAVE)) <= len(lengths) + WAVE
    assert rule_of(FIT["80 x 8k"], n_slots=80 + 3 * WAVE) < 4  # 320 slots do not fit


def test_fitted_schedule_shortens_the_simulated_makespan():
    """Over uniform batches of 1-256 requests of 1K-32K keys and random mixed batches (empty
    and one-key requests among them), the fitted schedule's simulated makespan (one tile
    of cost a split) is 1.15x shorter than the unfitted one's on geometric mean (1.19x
    when written), and none longer by 5% (none longer at all when written)."""
    rng = random.Random(0)
    cases = [[keys] * batch for batch in (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128,
                                          192, 256) for keys in (1024, 4096, 8192, 32768)]
    cases += [[PAIR * int(2 ** rng.uniform(2, 8)) for _ in range(rng.choice([16, 32, 64, 128]))]
              for _ in range(12)]
    cases += [[int(2 ** rng.uniform(0, 16)) - 1 for _ in range(rng.choice([8, 16, 32, 64, 200]))]
              for _ in range(24)]
    ratios = [simulated_makespan(fitted(lengths, 0), lengths)
              / simulated_makespan(fitted(lengths), lengths) for lengths in cases]
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) >= 1.15
    assert min(ratios) >= 0.95


def used(table):
    return [row for row in table if row[0] >= 0]


def used_slots(table):
    return len(used(table))


@pytest.mark.compile
@pytest.mark.parametrize("name", FIT)
def test_fitted_schedule_program_on_the_cpu(name):
    """The fitted schedule program (each rule's slots, longest split and long splits
    totalled per thread, reduced by shuffles and one barrier, the lowest estimate taken)
    writes exactly the model's slot table and ends."""
    import tilelang

    from ..cuda_emulation_threads import run

    lengths = FIT[name]
    compiled = tilelang.compile(schedule_program(1, PAIR, -1, True, fit_waves=FIT_WAVES),
                                target=_planned_kernel().target)
    n_slots = len(lengths) + FIT_WAVES * WAVE
    slot_table = torch.full((n_slots, 4), -77, dtype=torch.int32)
    split_ends = torch.full((len(lengths),), -77, dtype=torch.int32)
    run(compiled, 1, SCHEDULE_THREADS,
        dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), slot_table=slot_table,
             split_ends=split_ends),
        dict(batch=len(lengths), n_slots=n_slots, target_slots=WAVE))
    table, ends = schedule_model(lengths, 1, PAIR, -1, True, WAVE, n_slots, FIT_WAVES)
    assert split_ends.tolist() == ends
    assert slot_table.tolist() == table


@pytest.mark.compile
@pytest.mark.parametrize("chunk", [None, 32], ids=["whole-rows", "chunks-of-32"])
def test_planned_combine_on_the_cpu(chunk):
    """The planned combine (tests/cuda_emulation.py): a request of several slots gets the
    lse-weighted merge of its own slots wherever the schedule laid them (not in request
    order: longest splits first), one of a single split is left as the attention program
    wrote it, an all-empty request gets 0 and -inf; with `chunk`, four CTAs a row, each
    merging its 32 columns, the first storing the lse."""
    import tilelang

    from ..cuda_emulation import run

    compiled = (_planned_program(2, q_len=2, heads=4) if chunk is None else tilelang.compile(
        combine_program(4, 128, 2, "bfloat16", planned=True, chunk=chunk),
        target=_planned_kernel().target))
    ctas, threads = (3 * 2 * 4, 64) if chunk is None else (3 * 2 * 4 * 128 // chunk, 32)
    # request 0: slots 2-4; request 1: slot 5 (direct); request 2: slots 0-1 (empty runs)
    ends = torch.tensor([5, 6, 2], dtype=torch.int32)
    slot_table = torch.tensor([[2, 0, 0, 2], [2, 0, 0, 2], [0, 0, 0, 3], [0, 0, 0, 3],
                               [0, 0, 0, 3], [1, 0, 0, 1], [-1, 0, 0, 0]], dtype=torch.int32)
    torch.manual_seed(0)
    o_part = torch.randn(7, 2, 4, 128)
    lse_part = torch.randn(7, 2, 4) * 4
    lse_part[3] = -math.inf  # an empty run of request 0
    lse_part[0:2] = -math.inf
    o_part[0:2] = 0.0
    o = torch.full((3, 2, 4, 128), math.nan).to(BF16)
    lse = torch.full((3, 4, 2), math.nan)
    run(_HostMath(compiled), ctas, threads,
        dict(o_part=o_part, lse_part=lse_part, slot_table=slot_table, split_ends=ends, o=o,
             lse=lse),
        dict(batch=3, n_slots=7))
    want_lse = torch.logsumexp(lse_part[2:5], dim=0)  # [Sq, H]
    weights = torch.exp(lse_part[2:5] - want_lse).nan_to_num(0.0)
    want_o = (weights[..., None] * o_part[2:5]).sum(0)
    torch.testing.assert_close(o[0].float(), want_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[0], want_lse.transpose(0, 1))
    assert torch.isnan(o[1].float()).all() and torch.isnan(lse[1]).all()  # left alone
    assert torch.equal(o[2].float(), torch.zeros(2, 4, 128))
    assert torch.isinf(lse[2]).all() and (lse[2] < 0).all()


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("q_len, heads, window_left", [(1, 32, -1), (4, 32, 4095)])
def test_planned_program_uses_tma_and_wgmma_without_spills(q_len, heads, window_left,
                                                           tmp_path):
    """The planned attention in a TMA config keeps the first slice's TMA + wgmma pipeline
    (the slot's request and tile run are global loads, not registers carried into it);
    ptxas: no spills, no serialized wgmma. (Page 16's default gathers instead.)"""
    compiled = _planned_program(1, q_len, heads, 8, window_left,
                                DecodeConfig(128, 2, hoist_pages=True))
    source = compiled.get_kernel_source()
    assert "tma_load" in source and "wgmma" in source and "warpgroup_reg_alloc" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("page_size", [16, 64])
def test_long_chunk_programs_compile_without_spills(page_size, tmp_path):
    """The default 128-row chunked-prefill programs (Qwen3-32B heads), wgmma on two
    consumer warpgroups after a producer warpgroup (384 threads): at page 64 its TMA tiles
    (TileLang's warp specialization), at page 16 its own cp.async gather into 3 stages;
    nothing spilled or serialized either way."""
    import tilelang

    kernel = ChunkedPrefillKernel(dtype="bfloat16", heads=64, kv_heads=8, head_dim=128,
                                  q_len=0, page_size=page_size, window_left=-1, softcap=0.0,
                                  causal=True)
    config = kernel.heuristic_config("direct", "sm_90a")
    assert config.block_m == 2 * ROWS and config.producer_gather == (page_size == 16)
    compiled = tilelang.compile(kernel.program(config, "direct"), target=kernel.target,
                                pass_configs=kernel.pass_configs(config, 0))
    source = compiled.get_kernel_source()
    assert "wgmma" in source and "__launch_bounds__(384" in source
    if config.producer_gather:
        assert config.stages == 3
        assert "cp_async" in source and "tma_load" not in source
        assert "mbarrier_cp_async_arrive_noinc" in source
    else:
        assert "tma_load" in source and "warpgroup_reg_alloc" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("page_size, block_n, stages, kv_dtype, tma", [
    (16, 128, 2, None, False), (32, 64, 3, None, False), (16, 128, 3, None, True),
    (16, 64, 2, "float8_e4m3fn", False), (0, 128, 2, "float8_e4m3fn", False)])
def test_producer_gather_program_compiles_without_spills(page_size, block_n, stages,
                                                         kv_dtype, tma, tmp_path):
    """`producer_gather`: a producer warpgroup (384 threads in all) fills the K/V stages;
    over 16-bit pages by cp.async, each stage announced on one barrier per tensor
    (cp.async.mbarrier.arrive), the tile's page ids loaded once for K and V (or, with
    `producer_tma`, by one thread's TMA copies a page and 64 columns, their bytes expected
    on that barrier); over an fp8 cache (paged or contiguous) by loads it widens to fp16
    itself, fenced for the wgmmas before it arrives. The consumers wait on those barriers
    and run wgmma; nothing spilled or serialized."""
    extra = {"kv_dtype": kv_dtype} if kv_dtype else {}
    kernel = ChunkedPrefillKernel(dtype="bfloat16", heads=64, kv_heads=8, head_dim=128,
                                  q_len=0, page_size=page_size, window_left=-1, softcap=0.0,
                                  causal=True, **extra)
    config = DecodeConfig(block_n, stages, producer_gather=True, producer_tma=tma,
                          block_m=2 * ROWS)
    assert config in kernel.config_space("direct")
    compiled = kernel.compile(config, "direct")[0]
    source = compiled.get_kernel_source()
    assert "__launch_bounds__(384" in source and ("tma_load" in source) == tma
    assert "wgmma" in source and "warpgroup_reg_dealloc<72>" in source
    assert "warpgroup_reg_alloc<216>" in source  # 128 x 72 + 256 x 216 = 384 x 168
    if tma:  # 8 pages x 2 column halves for K and V, no cp.async, nothing to fence
        assert source.count("tma_load(") == 2 and "cp_async" not in source
        assert source.count("fence_proxy_async") == 1  # (the q tile's, before the loop)
    elif kv_dtype:
        assert "cp_async" not in source and "fp8_e4_8_t" in source  # 8-byte loads
    else:
        assert source.count("mbarrier_cp_async_arrive_noinc") == 2  # K and V of a stage
        # one load a page, in the unrolled loop over the tile's pages, for K and V alike
        assert source.count("block_table[") == 1 and "cp_async_gs" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


def compile_fp8_producer(page_size: int, config: DecodeConfig):
    """The attention program of the Llama-8B-shaped planned decode over an fp8 cache for
    `config` (a producer_gather config of its space)."""
    kernel = PlannedDecodeKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128,
                                 q_len=1, page_size=page_size, window_left=-1, softcap=0.0,
                                 causal=True, kv_dtype="float8_e4m3fn")
    assert config in kernel.config_space("planned")
    return kernel.compile(config, "planned")[1]


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("page_size, stages, ctas_per_sm, key_major, fetch_both", [
    (16, 3, 2, False, False), (64, 2, 1, False, False), (16, 2, 3, True, False),
    (64, 3, 2, False, True), (16, 2, 3, True, True)])
def test_planned_fp8_decode_widened_by_a_producer_compiles(page_size, stages, ctas_per_sm,
                                                           key_major, fetch_both, tmp_path):
    """The planned decode over an fp8 cache with `producer_gather`: 128 consumer and 128
    producer threads, the register split within the launch's (72 / 184 at two CTAs an SM,
    72 / 88 for key-major consumers at three), nothing spilled or serialized, with or
    without V's tile fetched alongside K's."""
    compiled = compile_fp8_producer(page_size, DecodeConfig(
        64, stages, producer_gather=True, ctas_per_sm=ctas_per_sm, key_major=key_major,
        fetch_both=fetch_both))
    source = compiled.get_kernel_source()
    bound = f"__launch_bounds__(256, {ctas_per_sm})" if ctas_per_sm > 1 else \
        "__launch_bounds__(256"
    assert bound in source and "tma_load" not in source and "wgmma" in source
    producer, consumer = gather_registers(128, ctas_per_sm)
    assert f"warpgroup_reg_dealloc<{producer}>" in source
    assert f"warpgroup_reg_alloc<{consumer}>" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("page_size", [16, 64, 0])
@pytest.mark.parametrize("key_major, land, stages, ctas_per_sm", [
    (True, 4, 2, 1), (True, 3, 1, 2), (True, 2, 2, 2), (True, 4, 1, 2), (False, 3, 2, 1),
    (False, 2, 2, 2)])
def test_fp8_landing_ring_compiles(page_size, key_major, land, stages, ctas_per_sm, tmp_path):
    """`land_stages`: the producer's fp8 tiles land by TMA (an elected thread, a page and
    K / V a copy, the bytes expected on the slot's barrier) land - 1 tiles ahead of the
    widening, slots released on a second barrier; nothing spilled or serialized."""
    compiled = compile_fp8_producer(page_size, DecodeConfig(
        64, stages, producer_gather=True, ctas_per_sm=ctas_per_sm, key_major=key_major,
        land_stages=land))
    source = compiled.get_kernel_source()
    assert source.count("tma_load(") == 4  # K and V, in the prologue and in the loop
    assert "expect_transaction" in source and "wgmma" in source
    producer, consumer = gather_registers(128, ctas_per_sm)
    assert f"warpgroup_reg_dealloc<{producer}>" in source
    assert f"warpgroup_reg_alloc<{consumer}>" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_hoisted_page_ids_load_once_per_page_without_spills(kv_dtype, tmp_path):
    """`hoist_pages` at page 16: the producer loads each page id of a tile once (K and V
    share them), not once per TMA piece; TMA and wgmma kept, nothing spilled."""

    extra = {"kv_dtype": kv_dtype} if kv_dtype else {}
    kernel = PlannedDecodeKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128,
                                 q_len=1, page_size=16, window_left=-1, softcap=0.0,
                                 causal=True, **extra)
    config = DecodeConfig(128, 2, hoist_pages=True)  # (16-bit caches gather by default)
    assert config in kernel.config_space("planned")
    compiled = kernel.compile(config, "planned")[1]
    source = compiled.get_kernel_source()
    assert source.count("block_table[") == config.block_n // 16
    assert "tma_load" in source and "wgmma" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.smoke
def test_decode_plan_argument_errors():
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'num_kv_heads'"):
        tileops.plan_decode(4, 30, 8, 128, device="cpu")
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'num_kv_heads'"):
        tileops.plan_decode(4, 30, 8, 128)  # checked before the (CUDA) device is resolved
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'page_size'"):
        tileops.plan_decode(4, 32, 8, 128, page_size=24, device="cpu")
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'head_dim'"):
        tileops.plan_decode(4, 32, 8, 96, device="cpu")
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'batch_size'"):
        tileops.plan_decode(0, 32, 8, 128, device="cpu")
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'q_len'"):
        tileops.plan_decode(4, 32, 8, 128, q_len=17, device="cpu")
    plan = tileops.plan_decode(4, 32, 8, 128, device="cpu", num_sms=132)
    assert plan.num_slots == 4 + GATHERED_SPLIT_WAVES * (132 // 8)
    assert plan.buffers.o_part.shape == (plan.num_slots, 1, 32, 128)
    q = torch.randn(3, 32, 128).to(BF16)
    k = torch.randn(64, 16, 8, 128).to(BF16)
    lens = torch.ones(4, dtype=torch.int32)
    table = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(TileOpsValueError, match=r"DecodePlan.run: argument 'q': expected "
                                                r"shape \[4, 1, 32, 128\]"):
        plan.run(q, k, k, lens, table)
    with pytest.raises(TileOpsValueError, match="DecodePlan.run: argument 'k_cache'"):
        plan.run(torch.randn(4, 32, 128).to(BF16), k, k, lens, None)
    with pytest.raises(TileOpsValueError, match="DecodePlan.schedule: argument 'cache_seqlens'"):
        plan.schedule(lens.long())


@pytest.mark.smoke
def test_append_launch_arguments(monkeypatch):
    op = KVCacheAppendFwdOp()
    log = _recording(op, monkeypatch)
    pages = torch.randn(4, 16, 2, 64).to(BF16)
    k_new = torch.randn(3, 2, 64).to(BF16)
    slots = torch.tensor([0, -1, 63])
    k_out, v_out = op.forward(k_new, k_new, pages, pages, slots)
    (key, tokens, args), = log
    assert k_out is pages and key == {"dtype": "bfloat16", "slot_dtype": "int64", "width": 128}
    assert tokens == 3 and args[0].shape == (3, 128) and args[2].shape == (64, 128)
    assert args[2].data_ptr() == pages.data_ptr()  # a view of the pool: written in place


# -- chunked prefill ----------------------------------------------------------------------
def packed(total=300, heads=32, kv_heads=8, head_dim=128, page=16, n_pages=256, batch=3,
           max_pages=64):
    return (meta(total, heads, head_dim), meta(n_pages, page, kv_heads, head_dim),
            meta(n_pages, page, kv_heads, head_dim), meta(batch + 1, dtype=torch.int32),
            meta(batch, dtype=torch.int32), meta(batch, max_pages, dtype=torch.int32))


@pytest.mark.smoke
def test_chunked_prefill_shapes_and_errors():
    o, lse = ChunkedPrefillAttentionFwdOp(max_seqlen_q=200)(*packed())
    assert o.shape == (300, 32, 128) and lse.shape == (300, 32) and lse.dtype == torch.float32
    bad_cu = packed()[:3] + (meta(5, dtype=torch.int32),) + packed()[4:]
    with pytest.raises(TileOpsValueError, match="`B1 == B \\+ 1`"):
        ChunkedPrefillAttentionFwdOp(max_seqlen_q=200)(*bad_cu)
    with pytest.raises(TileOpsTypeError, match="argument 'max_seqlen_q'"):
        ChunkedPrefillAttentionFwdOp(max_seqlen_q=2.0)
    o = tileops.chunked_prefill_attention(*packed()[:5], max_seqlen_q=200,
                                          block_table=packed()[5], window_left=63)
    assert o.shape == (300, 32, 128)


@pytest.mark.smoke
@pytest.mark.smoke
def test_heads_first_layout_checks_and_roofline():
    """kv_layout "HND" reads S and Hkv from dims 2 and 1: the same roofline as the NHD cache
    of the same sizes, and shape rules on the right dims; a layout name is checked."""
    q, k, v, lens, table = paged()
    kh, vh = meta(64, 8, 16, 128), meta(64, 8, 16, 128)
    assert (DecodeAttentionFwdOp(kv_layout="HND").eval_roofline(q, kh, vh, lens, table)
            == DecodeAttentionFwdOp().eval_roofline(q, k, v, lens, table))
    o, lse = DecodeAttentionFwdOp(kv_layout="HND")(q, kh, vh, lens, table)
    assert o.shape == q.shape and o.device.type == "meta"
    with pytest.raises(TileOpsValueError, match="S in \\(16, 32, 64, 128, 256\\)"):
        DecodeAttentionFwdOp(kv_layout="HND")(q, k, v, lens, table)  # NHD pages: S = 8
    with pytest.raises(TileOpsValueError, match="kv_layout in"):
        DecodeAttentionFwdOp(kv_layout="NDH")(q, k, v, lens, table)
    with pytest.raises(TileOpsValueError, match="DecodePlan: argument 'kv_layout'"):
        tileops.plan_decode(4, 32, 8, 128, kv_layout="BSHD", device="cpu")
    contiguous = meta(4, 8, 3000, 128)
    assert ChunkedPrefillAttentionFwdOp(max_seqlen_q=8, kv_layout="HND").eval_roofline(
        meta(20, 32, 128), contiguous, contiguous, meta(5, dtype=torch.int32),
        meta(4, dtype=torch.int32), None) == ChunkedPrefillAttentionFwdOp(
        max_seqlen_q=8).eval_roofline(meta(20, 32, 128), meta(4, 3000, 8, 128),
                                      meta(4, 3000, 8, 128), meta(5, dtype=torch.int32),
                                      meta(4, dtype=torch.int32), None)


def test_chunked_prefill_roofline():
    q, k, v, _, _, table = packed(total=300, batch=3, page=16, max_pages=64)
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32)
    lens = torch.tensor([500, 1, 199], dtype=torch.int32)  # the last chunk is a fresh prefill
    flops, nbytes = ChunkedPrefillAttentionFwdOp(max_seqlen_q=199).eval_roofline(
        q, k, v, cu, lens, table)
    pairs = sum(400 + i + 1 for i in range(100)) + 1 + 199 * 200 // 2
    assert flops == 4 * 32 * 128 * pairs
    pages = (32 + 1 + 13) * 4
    assert nbytes == (2 * 700 * 8 * 128 + 2 * 300 * 32 * 128) * 2 + 300 * 32 * 4 + 7 * 4 + pages


@pytest.mark.smoke
def test_chunked_prefill_launch_arguments(monkeypatch):
    """Packed rows of one token each, q_len 0 in the program key, the grid's row blocks
    from max_seqlen_q (group 4 x 100 tokens = 400 rows: 7 blocks of 64, which the 128-row
    kernel of chunks of LONG_CHUNK tokens or more launches as 4)."""
    op = ChunkedPrefillAttentionFwdOp(max_seqlen_q=100)
    names = []
    log = _recording(op, monkeypatch, names)
    q = torch.randn(150, 8, 64).to(BF16)
    k = v = torch.randn(40, 32, 2, 64).to(BF16)
    cu = torch.tensor([0, 100, 150], dtype=torch.int32)
    lens = torch.tensor([600, 50], dtype=torch.int32)
    table = torch.randint(0, 40, (2, 20), dtype=torch.int32)
    o, lse = op.forward(q, k, v, cu, lens, table)
    (key, splits, args), = log
    assert key["q_len"] == 0 and key["page_size"] == 32 and key["causal"]
    q_arg, cu_arg, o_arg, lse_arg, blocks = args[0], args[5], args[8], args[9], args[12]
    assert q_arg.shape == (150, 1, 8, 64) and o_arg.shape == (150, 1, 8, 64)
    assert o_arg.data_ptr() == o.data_ptr() and lse_arg.shape == (150, 8, 1)
    assert cu_arg is cu and blocks == 7
    assert splits == choose_splits(2, 2, 7, 640, 128)
    assert names == ["chunked_prefill_attention"]
    assert op.kernels_for(op.check((q, k, v, cu, lens, table))) == [
        ("chunked_prefill_attention", key, splits)]
    short = ChunkedPrefillAttentionFwdOp(max_seqlen_q=LONG_CHUNK - 1)
    assert short.kernels_for(short.check((q[:LONG_CHUNK - 1], k, v, cu // 100, lens,
                                          table)))[0][0] == "decode_attention"
    # the 128-row kernel's run converts the op's ROWS-row blocks to its own
    launched = []
    kernel = ChunkedPrefillKernel(**key)
    config = kernel.heuristic_config("direct", "sm_90a")
    assert config.block_m == 2 * ROWS and not config.gather  # page 32: TMA tiles
    kernel.run(config, (lambda *a: launched.append(a),), *args[:12], 7, 0.1)
    assert launched[0][-2] == 4


# -- fp8 caches ---------------------------------------------------------------------------
FP8 = torch.float8_e4m3fn


def fp8_paged(batch=4, heads=32, kv_heads=8, head_dim=128, page=16, n_pages=64, max_pages=16,
              scales=1):
    return (meta(batch, 1, heads, head_dim), meta(n_pages, page, kv_heads, head_dim, dtype=FP8),
            meta(n_pages, page, kv_heads, head_dim, dtype=FP8), meta(batch, dtype=torch.int32),
            meta(batch, max_pages, dtype=torch.int32), meta(scales, dtype=torch.float32),
            meta(scales, dtype=torch.float32))


@pytest.mark.smoke
def test_fp8_ops_shapes_and_errors():
    from tileops import DecodeAttentionFp8FwdOp, KVCacheAppendFp8FwdOp

    o, lse = DecodeAttentionFp8FwdOp()(*fp8_paged(scales=8))
    assert o.shape == (4, 1, 32, 128) and o.dtype == BF16 and lse.shape == (4, 32, 1)
    with pytest.raises(TileOpsValueError, match=r"argument 'k_scale': expected shapes "
                                                r"satisfying `k_scale is None or"):
        DecodeAttentionFp8FwdOp()(*fp8_paged(scales=3))
    q, k, v, lens, table, ks, vs = fp8_paged()
    with pytest.raises(TileOpsTypeError, match="argument 'k_cache': expected dtype"):
        DecodeAttentionFp8FwdOp()(q, meta(64, 16, 8, 128), v, lens, table, ks, vs)
    with pytest.raises(TileOpsTypeError, match="argument 'k_cache'"):  # the 16-bit op
        DecodeAttentionFwdOp()(q, k, v, lens, table)
    with pytest.raises(TileOpsValueError, match="argument 'k_scale': expected None for a "
                                                "cache in q's dtype"):
        tileops.decode_attention(q, meta(64, 16, 8, 128), meta(64, 16, 8, 128), lens, table,
                                 k_scale=ks)
    pages = meta(64, 16, 8, 128, dtype=FP8)
    k_out, _ = KVCacheAppendFp8FwdOp()(meta(5, 8, 128), meta(5, 8, 128), pages, pages,
                                       meta(5, dtype=torch.int64), ks, vs)
    assert k_out.dtype == FP8 and k_out.shape == pages.shape


@pytest.mark.smoke
def test_fp8_roofline_counts_a_byte_per_cached_element():
    from tileops import DecodeAttentionFp8FwdOp

    q, k, v, _, table, ks, vs = fp8_paged(batch=3, page=16, n_pages=64, max_pages=20,
                                          scales=8)
    lens = torch.tensor([1, 100, 300], dtype=torch.int32)
    k16, v16 = meta(64, 16, 8, 128), meta(64, 16, 8, 128)
    _, bytes16 = DecodeAttentionFwdOp().eval_roofline(q, k16, v16, lens, table)
    flops, bytes8 = DecodeAttentionFp8FwdOp().eval_roofline(q, k, v, lens, table, ks, vs)
    assert bytes16 - bytes8 == 2 * 401 * 8 * 128 - 2 * 8 * 4
    assert flops == 4 * 32 * 128 * 401


@pytest.mark.smoke
@pytest.mark.parametrize("planned", [True, False])
def test_fp8_launch_arguments(planned, monkeypatch):
    """The fp8 op's program key names the cache dtype (the 16-bit keys stay as they were)
    and its scales reach the kernel flattened."""
    from tileops import DecodeAttentionFp8FwdOp

    op = DecodeAttentionFp8FwdOp()
    monkeypatch.setattr(op, "planned", planned)
    log = _recording(op, monkeypatch)
    q = torch.randn(2, 1, 8, 128).to(BF16)
    k = v = torch.randn(600, 16, 2, 128).to(FP8)
    table = torch.randint(0, 600, (2, 300), dtype=torch.int32)
    lens = torch.tensor([5, 4800], dtype=torch.int32)
    ks, vs = torch.tensor([[0.5], [0.25]]), torch.tensor([0.125, 0.75])
    op.forward(q, k, v, lens, table, ks, vs)
    (key, _, args), = log
    assert key["kv_dtype"] == "float8_e4m3fn" and key["dtype"] == "bfloat16"
    k_scale, v_scale = args[8:10] if planned else args[6:8]
    assert k_scale.tolist() == [0.5, 0.25] and v_scale.tolist() == [0.125, 0.75]
    with pytest.raises(TileOpsValueError, match="argument 'v_scale': expected as many"):
        op.forward(q, k, v, lens, table, ks, vs[:1])


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("page_size, head_dim", [(64, 128), (16, 128), (0, 128), (32, 256),
                                                 (16, 64)])
def test_fp8_programs_use_tma_and_wgmma(page_size, head_dim, tmp_path):
    """The consumers' widening (the default where `producer_tested` is not, e.g. head_dim
    64 and 256; in the space elsewhere, where a producer widens by default): fp8 tiles
    land by TMA (128-byte swizzle), the consumers widen them to fp16 for wgmma, bf16
    queries included (one conversion per two values; TileLang puts a fence.proxy.async
    before each wgmma that reads them), two CTAs an SM where they fit."""
    import tilelang

    kernel = PlannedDecodeKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=head_dim,
                                 q_len=1, page_size=page_size, window_left=-1, softcap=0.0,
                                 causal=True, kv_dtype="float8_e4m3fn")
    config = kernel.heuristic_config("planned", "sm_90a")
    assert config.producer_gather == (head_dim == 128)
    if config.producer_gather:
        config = DecodeConfig(64, 3, hoist_pages=0 < page_size < 64, ctas_per_sm=2)
        assert config in kernel.config_space("planned")
    compiled = tilelang.compile(kernel.program(config, "planned")[1], target=kernel.target)
    source = compiled.get_kernel_source()
    assert "tma_load" in source and "wgmma" in source and "fence_proxy_async" in source
    assert "__tl_cvt_fp8x2_to_half2" in source and "e4m3x2_to_bfloat162" not in source
    assert f"__launch_bounds__(256, {config.ctas_per_sm})" in source
    assert config.ctas_per_sm == (1 if head_dim == 256 else 2)
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.compile
@pytest.mark.parametrize("q_len, heads", [(1, 32), pytest.param(4, 32, marks=pytest.mark.full),
                                          pytest.param(1, 64, marks=pytest.mark.full)])
def test_key_major_programs_pad_rows_to_16(q_len, heads, tmp_path):
    """Key-major: S^T = K Q^T and O^T += V^T P^T as m64 x n(rows) wgmmas (rows = the CTA's
    group x q_len padded to 16), the softmax's reductions within a warp (8 lanes a row,
    no cross-warp rounds), nothing spilled; K and V share one widened tile."""
    kernel = PlannedDecodeKernel(dtype="bfloat16", heads=heads, kv_heads=8, head_dim=128,
                                 q_len=q_len, page_size=64, window_left=-1, softcap=0.0,
                                 causal=True, kv_dtype="float8_e4m3fn")
    config = DecodeConfig(64, 2, ctas_per_sm=2, key_major=True)
    assert config in kernel.config_space("planned")
    compiled = kernel.compile(config, "planned")[1]
    source = compiled.get_kernel_source()
    rows = key_major_rows(heads // 8, q_len, ROWS)
    assert rows == (16 if heads // 8 * q_len <= 16 else 32)
    assert f"kFloat32, 64, {rows}, 16" in source  # m64 n(rows) k16 wgmmas
    assert "AllReduce<tl::MaxOp, 8, 1" in source and "AllReduce<tl::MaxOp, 128" not in source
    # one widened tile for K and V (named after whichever variable TileLang saw last)
    assert sum(f"void* {name} =" in source for name in ("k_shared", "v_shared")) == 1
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


def test_key_major_configs_only_where_they_compile_and_fit():
    """Key-major configs: decode rows only (not packed chunks), 64-key tiles (TileLang
    cannot lower 128-key ones), three CTAs an SM only where shared memory holds them."""
    base = dict(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128, q_len=1, page_size=16,
                window_left=-1, softcap=0.0, causal=True, kv_dtype="float8_e4m3fn")
    space = PlannedDecodeKernel(**base).config_space("planned")
    major = [c for c in space if c.key_major]
    assert major and all(c.block_n == 64 for c in major)
    assert any(c.ctas_per_sm == 3 for c in major)
    packed = DecodeAttentionKernel(**{**base, "q_len": 0}).config_space("split")
    assert not any(c.key_major for c in packed)
    kernel = PlannedDecodeKernel(**base)
    assert kernel.fitting([DecodeConfig(128, 2, key_major=True)]) == []
    wide = PlannedDecodeKernel(**{**base, "head_dim": 256})
    assert not any(c.ctas_per_sm == 3 for c in wide.config_space("planned"))


@pytest.mark.compile
def test_fp8_append_program_saturates_and_vectorizes():
    from tileops.kernels.attention.kv_cache import KVCacheAppendKernel

    kernel = KVCacheAppendKernel(dtype="bfloat16", slot_dtype="int64", width=1024,
                                 cache_dtype="float8_e4m3fn", head_dim=128)
    source = kernel.compile(kernel.heuristic_config("all", "sm_90a"), "all")[0] \
        .get_kernel_source()
    assert "__NV_SATFINITE" in source and "4.480000e+02" in source
    assert "fp8_e4_4_t" in source  # 4-byte vector stores


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("block_n", [64, 128])
def test_gathered_pages_use_cp_async_without_spills(block_n, tmp_path):
    """`gather` at page 16: the tile's rows arrive by 16-byte cp.async gathers in a
    software pipeline of all threads (no TMA, no warp specialization), wgmma kept, nothing
    spilled; only 16-bit caches with pages shorter than 64 keys get such configs."""
    kernel = PlannedDecodeKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128,
                                 q_len=1, page_size=16, window_left=-1, softcap=0.0,
                                 causal=True)
    config = DecodeConfig(block_n, 1, gather=True)
    assert config in kernel.config_space("planned")
    assert kernel.pass_configs(config, 1) == {
        "tl.disable_warp_specialized": True,
        "tl.Simplify": {"enable_simplify_let_inline": False}}
    assert kernel.pass_configs(config, 0) == {}
    compiled = kernel.compile(config, "planned")[1]
    source = compiled.get_kernel_source()
    assert "cp_async_gs" in source and "wgmma" in source and "tma_load" not in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)
    for key in ({"page_size": 64}, {"page_size": 16, "kv_dtype": "float8_e4m3fn"}):
        other = PlannedDecodeKernel(**{**kernel.key, **key})
        assert not any(c.gather for c in other.config_space("planned"))


def test_page_16_default_gathers_unless_fp8():
    """16-bit caches with 16-key pages gather their rows by default (128-key tiles for one
    query row, 64 for packed queries), sliding windows included; longer pages keep TMA
    tiles, and fp8 caches a producer warpgroup's widening into 3 stages of 64-key tiles at
    two CTAs an SM (head_dim 256, not measured with it: 64-key TMA tiles, one CTA an SM,
    where two do not fit in shared memory)."""
    base = dict(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128, q_len=1, page_size=16,
                window_left=-1, softcap=0.0, causal=True)
    widened = DecodeConfig(64, 3, producer_gather=True, ctas_per_sm=2)
    for key, want in [
        ({}, DecodeConfig(128, 1, gather=True)),
        ({"q_len": 0}, DecodeConfig(64, 1, gather=True)),
        ({"window_left": 4095}, DecodeConfig(128, 1, gather=True)),
        ({"window_left": 0, "q_len": 0}, DecodeConfig(64, 1, gather=True)),
        ({"kv_dtype": "float8_e4m3fn"}, widened),
        ({"kv_dtype": "float8_e4m3fn", "q_len": 0}, widened),
        ({"kv_dtype": "float8_e4m3fn", "head_dim": 256}, DecodeConfig(64, 2, hoist_pages=True)),
        ({"kv_dtype": "float8_e4m3fn", "page_size": 0}, widened),
        ({"page_size": 64}, DecodeConfig(128, 2, hoist_pages=True)),
    ]:
        kernel = PlannedDecodeKernel(**{**base, **key})
        assert kernel.heuristic_config("planned", "sm_90a") == want, key


@pytest.mark.compile
@pytest.mark.full
def test_windowed_gathered_pages_compile_in_seconds(tmp_path):
    """A sliding window's gathered program keeps the simplifier's lets (inlined, the
    window's tile range made TileLang's simplifier run for 4-5 minutes a program): the
    slowest case measured, head_dim 256 with a softcap and a 127-key window, builds with
    cp.async gathers, wgmma and no spills."""
    import time

    kernel = PlannedDecodeKernel(dtype="bfloat16", heads=16, kv_heads=8, head_dim=256,
                                 q_len=1, page_size=16, window_left=127, softcap=30.0,
                                 causal=True)
    config = DecodeConfig(64, 1, gather=True)
    assert kernel.pass_configs(config, 1) == {
        "tl.disable_warp_specialized": True,
        "tl.Simplify": {"enable_simplify_let_inline": False}}
    start = time.monotonic()
    compiled = kernel.compile(config, "planned")[1]
    assert time.monotonic() - start < 150  # 26 s on a 2-core machine; inlined: 250-350 s
    source = compiled.get_kernel_source()
    assert "cp_async_gs" in source and "wgmma" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)
