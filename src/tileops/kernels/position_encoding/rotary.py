"""Rotary position embedding: one program family for both the forward and its transpose.

Two forms share the per-head body:

- `hf`: Hugging Face's apply_rotary_pos_emb. cos/sin hold one value per rotated element
  ([Bc, S, R], Bc = 1 broadcasts over the batch), y = x * cos + rotate(x) * sin on the first
  R of D elements; the rest pass through. q/k are [B, S, H, D] or [B, H, S, D] with any strides
  whose last one is 1. The backward is the exact transpose: dx = dy * cos - rotate(dy * sin).
- `cache`: vLLM's rotary_embedding on packed tokens. One row of a [max_pos, R] table per token,
  picked by `positions`, holds cos in its first R/2 entries and sin in the rest (one pair each).

Memory-bound: every element is read once and written once, in 16-byte vectors. A thread owns
one rotation unit (2 * vec elements: vec pairs) of `heads_per_thread` heads of one token. It
loads the unit's cos/sin once, issues all its heads' loads (their pass-through vectors
included) before any math (so a thread has at least 2 * heads_per_thread 16-byte loads in
flight), rotates in fp32 and stores in the input dtype.
NeoX style pairs element j with j + R/2 (a unit is a vector of each half); GPT-J style
(`interleaved`) pairs 2i with 2i + 1 (a unit is two adjacent vectors). Token counts are
symbolic; head counts, head_dim, rotary_dim, layout and flags are compiled in.
"""

import dataclasses
from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel

VEC_BYTES = 16
FEW_TOKENS = 128  # bucket edge: up to this many tokens (decode batches) a CTA takes one token
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def vector_width(dtype: str, rotary_dim: int, head_dim: int) -> int:
    """Elements per vector: 16 bytes where the half-rotary and head sizes allow it."""
    vec = VEC_BYTES // _ELEM_BYTES[dtype]
    while vec > 1 and ((rotary_dim // 2) % vec or head_dim % vec):
        vec //= 2
    return vec


@dataclass(frozen=True)
class RotaryConfig:
    """heads_per_thread: heads a thread rotates (its loads in flight); block_tokens: tokens
    per CTA; head_chunks: CTAs sharing a token's heads (each takes ceil(heads / head_chunks)
    of them). A CTA runs block_tokens * ceil(chunk heads / heads_per_thread) * units
    threads. The grid is chunk-major: the CTAs resident at once work on one chunk of heads
    over many consecutive tokens, so in the [B, H, S, D] layout they stream a few heads'
    contiguous planes instead of all heads' at once (72 for Llama-3.1-70B)."""

    heads_per_thread: int = 4
    block_tokens: int = 1
    head_chunks: int = 1
    # a launch bound for that many resident CTAs (0: none): TileLang's default bound of one
    # CTA leaves ptxas 84-119 registers a thread (72 heads at 4 x 2 tokens: 96, two CTAs of
    # 288 an SM). Tuner option only: on the H200 (bf16, 2026-12-04) bounds of 3 / 4 ran the
    # token-major 70B prefill in 78.3 / 85.0 us against 75.5 unbound; only the 70B
    # [B, H, S, D] backward gained (79.6 against 83.2 at 4)
    ctas_per_sm: int = 0


def chunk_heads(heads: int, config: RotaryConfig) -> int:
    return -(-heads // config.head_chunks)


def thread_layout(heads: int, units: int, config: RotaryConfig) -> tuple[int, int]:
    """(head groups per token of one chunk, threads per CTA, a multiple of the warp size)."""
    groups = -(-chunk_heads(heads, config) // config.heads_per_thread)
    used = config.block_tokens * groups * units
    return groups, -(-used // 32) * 32


def rotary_program(form: str, dtype: str, table_dtype: str, q_heads: int, k_heads: int,
                   head_dim: int, rotary_dim: int, interleaved: bool, backward: bool,
                   bhsd: bool, inplace: bool, vec: int, heads_per_thread: int,
                   block_tokens: int, head_chunks: int = 1, ctas_per_sm: int = 0):
    """The prim_func of one (form, shape, flags, config).

    hf:    (q, k, cos, sin, q_out, k_out)
    cache: (positions, q, k, cos_sin_cache[, q_out, k_out]); `inplace` writes q and k.
    """
    config = RotaryConfig(heads_per_thread, block_tokens, head_chunks)
    heads = q_heads + k_heads
    per_chunk = chunk_heads(heads, config)
    half = rotary_dim // 2
    units = half // vec
    groups, threads = thread_layout(heads, units, config)
    used = block_tokens * groups * units
    width = 2 * vec
    pass_vecs = (head_dim - rotary_dim) // vec
    pass_iters = -(-pass_vecs // units) if not inplace else 0
    hpt = heads_per_thread
    accum = "float"

    def head_of(g, i, h0):
        """Head slot i of group g in the chunk from head h0; `heads` (none) past the chunk."""
        if head_chunks == 1:
            return g + i * groups
        return T.if_then_else(g + i * groups < per_chunk, h0 + g + i * groups, heads)

    def unit_offsets(u):
        """Element offsets of the unit's two vectors within a head."""
        if interleaved:
            return u * width, u * width + vec
        return u * vec, half + u * vec

    @T.macro
    def rotate(x_local, c_local, s_local, y_local, i):
        """y = x * cos + rotate(x) * sin (forward) or its transpose; pairs (e, e + vec) or
        (2m, 2m + 1) of the 2 * vec elements of head slot i."""
        if interleaved:
            for m in T.unroll(vec):
                a = T.cast(x_local[i, 2 * m], accum)
                b = T.cast(x_local[i, 2 * m + 1], accum)
                if backward:
                    y_local[2 * m] = T.cast(a * c_local[2 * m] + b * s_local[2 * m + 1], dtype)
                    y_local[2 * m + 1] = T.cast(b * c_local[2 * m + 1] - a * s_local[2 * m],
                                                dtype)
                else:
                    y_local[2 * m] = T.cast(a * c_local[2 * m] - b * s_local[2 * m], dtype)
                    y_local[2 * m + 1] = T.cast(b * c_local[2 * m + 1] + a * s_local[2 * m + 1],
                                                dtype)
        else:
            for e in T.vectorized(vec):
                a = T.cast(x_local[i, e], accum)
                b = T.cast(x_local[i, vec + e], accum)
                if backward:
                    y_local[e] = T.cast(a * c_local[e] + b * s_local[vec + e], dtype)
                    y_local[vec + e] = T.cast(b * c_local[vec + e] - a * s_local[e], dtype)
                else:
                    y_local[e] = T.cast(a * c_local[e] - b * s_local[e], dtype)
                    y_local[vec + e] = T.cast(b * c_local[vec + e] + a * s_local[vec + e], dtype)

    @T.macro
    def load_head(src, x_local, token, hh, i, oa, ob, u, index):
        """Head hh's unit (two vectors) and its pass-through vectors into slot i: every load
        of a thread is issued before its first use, so none waits on another's store."""
        for e in T.vectorized(vec):
            x_local[i, e] = src[index(token, hh, oa + e)]
        for e in T.vectorized(vec):
            x_local[i, vec + e] = src[index(token, hh, ob + e)]
        for j in T.unroll(pass_iters):
            p = rotary_dim + (u + j * units) * vec
            if p < head_dim:
                for e in T.vectorized(vec):
                    x_local[i, width + j * vec + e] = src[index(token, hh, p + e)]

    @T.macro
    def store_head(dst, x_local, y_local, token, hh, i, oa, ob, u, index):
        for e in T.vectorized(vec):
            dst[index(token, hh, oa + e)] = y_local[e]
        for e in T.vectorized(vec):
            dst[index(token, hh, ob + e)] = y_local[vec + e]
        for j in T.unroll(pass_iters):
            p = rotary_dim + (u + j * units) * vec
            if p < head_dim:
                for e in T.vectorized(vec):
                    dst[index(token, hh, p + e)] = x_local[i, width + j * vec + e]

    @T.macro
    def heads_body(q, k, q_out, k_out, token, u, g, c_local, s_local, index, h0):
        """A thread's heads of one token (of the chunk from head h0): `index(token, h, d)` is
        a head element's index."""
        oa, ob = unit_offsets(u)
        x_local = T.alloc_local((hpt, width + pass_iters * vec), dtype)
        y_local = T.alloc_local((width,), dtype)
        for i in T.unroll(hpt):
            h = head_of(g, i, h0)
            if h < q_heads:
                load_head(q, x_local, token, h, i, oa, ob, u, index)
            elif h < heads:
                load_head(k, x_local, token, h - q_heads, i, oa, ob, u, index)
        for i in T.unroll(hpt):
            h = head_of(g, i, h0)
            if h < heads:
                rotate(x_local, c_local, s_local, y_local, i)
                if h < q_heads:
                    store_head(q_out, x_local, y_local, token, h, i, oa, ob, u, index)
                else:
                    store_head(k_out, x_local, y_local, token, h - q_heads, i, oa, ob, u,
                               index)

    shared = dict(units=units, groups=groups, threads=threads, used=used, width=width,
                  unit_offsets=unit_offsets, heads_body=heads_body, accum=accum,
                  head_chunks=head_chunks, per_chunk=per_chunk, ctas_per_sm=ctas_per_sm)
    if form == "hf":
        return _hf_program(dtype, q_heads, k_heads, head_dim, rotary_dim, bhsd, vec,
                           block_tokens, **shared)
    return _cache_program(dtype, table_dtype, q_heads, k_heads, head_dim, rotary_dim,
                          interleaved, inplace, vec, block_tokens, **shared)


def _hf_program(dtype, q_heads, k_heads, head_dim, rotary_dim, bhsd, vec, block_tokens, *,
                units, groups, threads, used, width, unit_offsets, heads_body, accum,
                head_chunks, per_chunk, ctas_per_sm):
    batch, seq, table_batch = T.dynamic("batch, seq, table_batch")
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh = T.dynamic("q_sb, q_ss, q_sh, k_sb, k_ss, k_sh",
                                                   "int64")
    c_sb, c_ss, s_sb, s_ss = T.dynamic("c_sb, c_ss, s_sb, s_ss", "int64")

    def dims(heads):
        return (batch, heads, seq, head_dim) if bhsd else (batch, seq, heads, head_dim)

    def strides(sb, ss, sh):
        return (sb, sh, ss, 1) if bhsd else (sb, ss, sh, 1)

    def index(token, h, d):
        return (token[0], h, token[1], d) if bhsd else (token[0], token[1], h, d)

    @T.prim_func
    def rotary_hf(
            q: T.StridedTensor(dims(q_heads), strides(q_sb, q_ss, q_sh), dtype),
            k: T.StridedTensor(dims(k_heads), strides(k_sb, k_ss, k_sh), dtype),
            cos: T.StridedTensor((table_batch, seq, rotary_dim), (c_sb, c_ss, 1), dtype),
            sin: T.StridedTensor((table_batch, seq, rotary_dim), (s_sb, s_ss, 1), dtype),
            q_out: T.Tensor(dims(q_heads), dtype),
            k_out: T.Tensor(dims(k_heads), dtype)):
        token_blocks = T.ceildiv(batch * seq, block_tokens)
        with T.Kernel(token_blocks * head_chunks, threads=threads) as bx:
            if ctas_per_sm:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            for stride in (q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, c_sb, c_ss, s_sb, s_ss):
                T.assume(stride % vec == 0)
            T.assume(seq > 0)
            T.assume(table_batch > 0)
            tx = T.get_thread_binding()
            u = tx % units
            g = (tx // units) % groups
            chunk, block = (bx // token_blocks, bx % token_blocks) if head_chunks > 1 \
                else (0, bx)
            token = block * block_tokens + tx // (units * groups)
            c_local = T.alloc_local((width,), accum)
            s_local = T.alloc_local((width,), accum)
            if tx < used and token < batch * seq:
                b = token // seq
                s = token % seq
                bc = T.min(b, table_batch - 1)
                oa, ob = unit_offsets(u)
                for e in T.vectorized(vec):
                    c_local[e] = cos[bc, s, oa + e]
                for e in T.vectorized(vec):
                    c_local[vec + e] = cos[bc, s, ob + e]
                for e in T.vectorized(vec):
                    s_local[e] = sin[bc, s, oa + e]
                for e in T.vectorized(vec):
                    s_local[vec + e] = sin[bc, s, ob + e]
                heads_body(q, k, q_out, k_out, (b, s), u, g, c_local, s_local, index,
                           chunk * per_chunk)

    return rotary_hf


def _cache_program(dtype, table_dtype, q_heads, k_heads, head_dim, rotary_dim, interleaved,
                   inplace, vec, block_tokens, *, units, groups, threads, used, width,
                   unit_offsets, heads_body, accum, head_chunks, per_chunk, ctas_per_sm):
    tokens, max_pos = T.dynamic("tokens, max_pos")
    q_st, q_sh, k_st, k_sh = T.dynamic("q_st, q_sh, k_st, k_sh", "int64")
    half = rotary_dim // 2

    def index(token, h, d):
        return (token[0], h, d)

    @T.macro
    def body(positions, q, k, cos_sin_cache, q_out, k_out):
        token_blocks = T.ceildiv(tokens, block_tokens)
        with T.Kernel(token_blocks * head_chunks, threads=threads) as bx:
            if ctas_per_sm:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            for stride in (q_st, q_sh, k_st, k_sh):
                T.assume(stride % vec == 0)
            T.assume(max_pos > 0)
            tx = T.get_thread_binding()
            u = tx % units
            g = (tx // units) % groups
            chunk, block = (bx // token_blocks, bx % token_blocks) if head_chunks > 1 \
                else (0, bx)
            t = block * block_tokens + tx // (units * groups)
            c_local = T.alloc_local((width,), accum)
            s_local = T.alloc_local((width,), accum)
            pair_cos = T.alloc_local((vec,), accum)
            pair_sin = T.alloc_local((vec,), accum)
            if tx < used and t < tokens:
                # out-of-range positions read the nearest row instead of faulting
                row = T.max(T.min(positions[t], T.cast(max_pos - 1, "int64")),
                            T.cast(0, "int64"))
                # a unit's vec pairs use one vector of cos and one of sin in both styles
                for e in T.vectorized(vec):
                    pair_cos[e] = T.cast(cos_sin_cache[row, u * vec + e], accum)
                for e in T.vectorized(vec):
                    pair_sin[e] = T.cast(cos_sin_cache[row, half + u * vec + e], accum)
                # element e of the unit belongs to pair e // 2 (GPT-J) or e % vec (NeoX)
                for e in T.unroll(width):
                    c_local[e] = pair_cos[e // 2 if interleaved else e % vec]
                    s_local[e] = pair_sin[e // 2 if interleaved else e % vec]
                heads_body(q, k, q_out, k_out, (t,), u, g, c_local, s_local, index,
                           chunk * per_chunk)

    if inplace:
        @T.prim_func
        def rotary_cache_inplace(
                positions: T.Tensor((tokens,), "int64"),
                q: T.StridedTensor((tokens, q_heads, head_dim), (q_st, q_sh, 1), dtype),
                k: T.StridedTensor((tokens, k_heads, head_dim), (k_st, k_sh, 1), dtype),
                cos_sin_cache: T.Tensor((max_pos, rotary_dim), table_dtype)):
            body(positions, q, k, cos_sin_cache, q, k)

        return rotary_cache_inplace

    @T.prim_func
    def rotary_cache(
            positions: T.Tensor((tokens,), "int64"),
            q: T.StridedTensor((tokens, q_heads, head_dim), (q_st, q_sh, 1), dtype),
            k: T.StridedTensor((tokens, k_heads, head_dim), (k_st, k_sh, 1), dtype),
            cos_sin_cache: T.Tensor((max_pos, rotary_dim), table_dtype),
            q_out: T.Tensor((tokens, q_heads, head_dim), dtype),
            k_out: T.Tensor((tokens, k_heads, head_dim), dtype)):
        body(positions, q, k, cos_sin_cache, q_out, k_out)

    return rotary_cache


def heuristic_layout(heads: int, units: int, block_threads: int = 128,
                     token_major: bool = False) -> RotaryConfig:
    """Heads per thread near 4 (eight 16-byte loads in flight, and the unit's cos/sin
    loads shared by that many heads) with few idle lanes, and enough tokens per CTA for
    ~block_threads threads.

    token_major (a token's heads contiguous: [B, S, H, D] or packed tokens): a head count
    that 4 divides takes exactly 4 a thread over the fewest tokens (1 or 2) that leave
    under a tenth of the lanes idle. On the H200 (bf16, 2026-12-04) that ran Llama-3.1-70B's
    72 heads in 76.4 us where 3 a thread (192 threads, no lane idle) took 81.8, Qwen3-32B's
    in 39.5 against 42.1, and 40 heads level or 1-2% faster than 5 a thread. The same rule
    over 1-4 tokens for every layout slowed DeepSeek-V3's 129 rope heads (36.4 -> 40.4 us,
    decode 2.3 -> 4.7) and the [B, H, S, D] 70B backward (84.0 -> 87.8): those keep the
    scored pick below."""
    if token_major and heads % 4 == 0:
        for block_tokens in (1, 2):
            config = RotaryConfig(4, block_tokens)
            _, threads = thread_layout(heads, units, config)
            if threads <= 512 and block_tokens * heads * units > 0.9 * threads * 4:
                return config
    # past 8192 slots per token (e.g. 512 heads of 256), as many heads per thread as fit
    best, best_score = RotaryConfig(-(-heads * units // 1024), 1), -1.0
    for hpt in range(1, 9):
        groups = -(-heads // hpt)
        block_tokens = max(1, block_threads // (groups * units))
        config = RotaryConfig(hpt, block_tokens)
        _, threads = thread_layout(heads, units, config)
        if threads > 1024:
            continue
        busy = block_tokens * heads * units / (threads * hpt)
        score = busy - 0.05 * abs(hpt - 4)
        if score > best_score:
            best, best_score = config, score
    return best


class RotaryKernel(Kernel):
    """key: form ('hf' | 'cache'), dtype, table_dtype, q_heads, k_heads, head_dim, rotary_dim,
    interleaved, backward, bhsd, inplace, planes (default False: [B, H, S, D] tensors laid
    out head plane by head plane in memory, not a transposed view of [B, S, H, D]; it only
    picks the default config). The hf form has two buckets of token counts, "few" (up to
    FEW_TOKENS: decode batches) and "all", the cache form one; within a bucket the token
    count only sets the grid."""

    name = "rotary"
    Config = RotaryConfig

    def __init__(self, *args, planes: bool = False, **key):
        super().__init__(*args, planes=planes, **key)
        # the "few" bucket's edge, fixed per kernel (bucket_of runs on every launch); the
        # cache form's decode rows already beat their baselines: one program for it
        self._few_tokens = FEW_TOKENS if self.key["form"] == "hf" else -1

    @property
    def vec(self) -> int:
        return vector_width(self.key["dtype"], self.key["rotary_dim"], self.key["head_dim"])

    @property
    def units(self) -> int:
        return self.key["rotary_dim"] // 2 // self.vec

    def program(self, config: RotaryConfig, bucket: str):
        key = {k: v for k, v in self.key.items() if k != "planes"}
        return rotary_program(**key, vec=self.vec,
                              heads_per_thread=config.heads_per_thread,
                              block_tokens=config.block_tokens,
                              head_chunks=config.head_chunks, ctas_per_sm=config.ctas_per_sm)

    def run(self, config: RotaryConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*tensors)

    def bucket_of(self, size: int) -> str:
        return "few" if size <= self._few_tokens else "all"

    def heuristic_config(self, bucket: str, arch: str) -> RotaryConfig:
        picked = self._layout_config()
        if bucket == "few" and picked.head_chunks == 1:
            # A decode batch fills few SMs whatever the layout: one token a CTA doubles the
            # CTAs of a two-token pick. On an H100 (bf16, fifty-eighth session) Llama-3.1-8B's
            # decode 64 ran 2.4 us against 2.6 for (4, 2) (1.05x; fp16 1.04x); fewer heads a
            # thread or head chunks 0.86-0.93x; decode 256 was level (5.3 vs 5.2), so it
            # stays in "all".
            return dataclasses.replace(picked, block_tokens=1)
        return picked

    def _layout_config(self) -> RotaryConfig:
        heads = self.key["q_heads"] + self.key["k_heads"]
        if self.key["planes"] and self.key["backward"] and heads % 2 == 0:
            # Head planes, two heads a thread over 16 tokens a CTA (128 threads at head_dim
            # 128): each CTA streams contiguous runs of two planes, as torch.compile's
            # elementwise kernel over the whole tensor does. On an H100 (bf16, fifty-eighth
            # session, compares on the bench's input pool) against the scored pick: the
            # Mistral-7B backward 116.7 vs 121.4 us (torch.compile 117.0), the 70B backward
            # 105.1 vs 109.2 (torch.compile 105.9), the 8B forward 60.2 vs 61.5; one head a
            # thread 0.98-1.00x the scored pick, eight tokens level with 16. On an H200
            # bench the 70B backward ran 80.0 us (the scored pick 83.2-83.6 in earlier
            # sessions) but the 8B forward 46.2 (the scored pick 41.3-44.2 before, against
            # torch.compile's 42.9-43.8 then and 43.7 now): the forward keeps the scored
            # pick until one H200 compares both (the command is in the performance
            # README's fifty-eighth session).
            return RotaryConfig(2, 16, heads // 2)
        return heuristic_layout(heads, self.units, token_major=not self.key["bhsd"])

    def config_space(self, bucket: str) -> list[RotaryConfig]:
        heads, units = self.key["q_heads"] + self.key["k_heads"], self.units
        space = [self.heuristic_config(bucket, "sm_90a")]
        for hpt in (1, 2, 3, 4, 6, 8):
            for block_tokens in (1, 2, 4, 8):
                config = RotaryConfig(hpt, block_tokens)
                groups, threads = thread_layout(heads, units, config)
                if hpt > heads or threads > 1024 or (block_tokens > 1 and threads > 512):
                    continue
                if block_tokens * heads * units >= 0.75 * threads * hpt:
                    space.append(config)
        # chunks of 8-24 whole heads (no CTA idles on a short last chunk), with several
        # tokens per CTA sharing its cos/sin loads
        for head_chunks in range(2, heads // 8 + 1):
            per_chunk = heads // head_chunks
            if heads % head_chunks or not 8 <= per_chunk <= 24:
                continue
            for hpt, block_tokens in ((2, 4), (4, 4), (2, 8)):
                config = RotaryConfig(hpt, block_tokens, head_chunks)
                groups, threads = thread_layout(heads, units, config)
                if 64 <= threads <= 512 and \
                        block_tokens * per_chunk * units >= 0.75 * threads * hpt:
                    space.append(config)
        # head planes: a CTA streams one or two heads over 8-16 consecutive tokens (in the
        # [B, H, S, D] layout, contiguous runs of each head's plane, as an elementwise
        # kernel over the whole tensor reads them; cos / sin are read once per head)
        for hpt in (1, 2):
            for block_tokens in (8, 16):
                if heads % hpt == 0 and heads > hpt:
                    space.append(RotaryConfig(hpt, block_tokens, heads // hpt))
        # the default under launch bounds of 3-6 resident CTAs that still fill at most the
        # SM's 2048 threads (ptxas then caps registers at 64K / (CTAs x threads); caps under
        # 40 left out: 56 already spilled 40 B at 72 heads, 48 spilled 116 B at 40)
        _, threads = thread_layout(heads, units, space[0])
        for ctas in (3, 4, 6):
            if ctas * threads <= 2048 and 65536 // (ctas * threads) >= 40:
                space.append(dataclasses.replace(space[0], ctas_per_sm=ctas))
        return list(dict.fromkeys(space))
