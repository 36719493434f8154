"""The total order both selection kernels rank elements by, as one unsigned 64-bit key.

`key = order(value) << (64 - width) | (index_span - index)`, where `order` maps the `width`
bits of a value (16 for fp16 / bf16, 32 for fp32) to an unsigned integer that compares like
the value, with every NaN above +inf (torch.argmax and torch.topk rank NaN highest) and -0.0
equal to +0.0 (torch compares them equal, so the lower index wins), and `index_span` is
2^L - 1 for the L bits a row position needs. So a larger key is a larger value, and among
equal values the lower index; keys are distinct within a row, which makes every selection
exact and deterministic. Bits of a key outside the value bits and the low L index bits are
always zero (`varying_bits`). No element's key is 0, which marks an empty slot.
"""

import tilelang.language as T

EMPTY = 0
_BITS = {"float16": ("uint16", 16, 0x7C00), "bfloat16": ("uint16", 16, 0x7F80),
         "float32": ("uint32", 32, 0x7F800000)}  # dtype -> (bits dtype, width, +inf bits)


def index_bits(vocab: int) -> int:
    return max(1, (vocab - 1).bit_length())


def varying_bits(dtype: str, vocab: int) -> int:
    """The mask of the key bits that can differ between two elements of a row."""
    width = _BITS[dtype][1]
    return (((1 << width) - 1) << (64 - width)) | ((1 << index_bits(vocab)) - 1)


def _order(value, dtype: str):
    """The order of a `dtype` value, in its bit width."""
    bits_t, width, inf = _BITS[dtype]
    sign, ones = 1 << (width - 1), (1 << width) - 1
    bits = T.reinterpret(value, bits_t)
    bits = T.if_then_else(bits == T.cast(sign, bits_t), T.cast(0, bits_t), bits)  # -0 -> +0
    is_nan = (bits & T.cast(sign - 1, bits_t)) > T.cast(inf, bits_t)
    ordered = T.if_then_else((bits & T.cast(sign, bits_t)) != T.cast(0, bits_t),
                             ~bits, bits | T.cast(sign, bits_t))
    return T.if_then_else(is_nan, T.cast(ones, bits_t), ordered)


def key_of(value, index, dtype: str, vocab: int):
    """The key of `value` (of `dtype`) at row position `index` (int32)."""
    width = _BITS[dtype][1]
    span = (1 << index_bits(vocab)) - 1
    return (T.cast(_order(value, dtype), "uint64") << T.uint64(64 - width)) | \
        T.cast(T.int32(span) - index, "uint64")


def index_of(key, vocab: int):
    """The row position of a key, as int64."""
    span = (1 << index_bits(vocab)) - 1
    return T.int64(span) - T.cast(key & T.uint64(span), "int64")


def larger(a, b):
    """max of two keys (written out: no unsigned 64-bit max overload is assumed)."""
    return T.if_then_else(a > b, a, b)


@T.macro
def track_best(x, index, best_val, best_idx):
    """Keeps (value, index) of the largest fp32 `x` seen by this thread, in key order.

    A thread sees its elements in increasing index order, so the strict compare keeps the
    lower index of equal values and the first NaN; this is the per-element fast path (no
    key is built), equivalent to `larger(key, key_of(x, index))`.
    """
    if best_idx[0] < 0 or x > best_val[0]:
        best_val[0] = x
        best_idx[0] = index
    elif T.isnan(x) and not T.isnan(best_val[0]):
        best_val[0] = x
        best_idx[0] = index


def best_key(best_val, best_idx, dtype: str, vocab: int):
    """The key of a thread's best element (tracked in fp32, exact for the input dtype), or
    EMPTY when it saw none."""
    return T.if_then_else(best_idx[0] < 0, T.uint64(EMPTY),
                          key_of(T.cast(best_val[0], dtype), best_idx[0], dtype, vocab))
