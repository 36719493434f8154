"""16-byte vector accesses, shared by the elementwise and row kernels."""

ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def vector_width(n: int, dtype: str) -> int:
    """Elements per access: the widest power of two <= 16 bytes that divides n, so a vector
    never crosses a row of n elements."""
    vec = 16 // ELEM_BYTES[dtype]
    while n % vec:
        vec //= 2
    return vec
