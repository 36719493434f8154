"""The small CUDA functions kernels reach with T.call_extern (fast_math, l2_hints), imported
into a kernel's source as one text.

TileLang keeps one imported source a kernel: a second T.import_source with different text
is refused ("merge two annotations with different values"), the same text twice is merged.
So every helper module imports this whole text, and a kernel using both kinds calls each
module's import freely.
"""

import tilelang.language as T


def import_source():
    """Call inside a T.Kernel body (more than once is fine)."""
    from . import fast_math, l2_hints  # they call this: imported here, not at module load

    T.import_source(fast_math.CUDA_SOURCE + l2_hints.CUDA_SOURCE)
