"""The tile ranges the attention kernels walk, against brute force over (query, key) pairs.

The kernels evaluate the same formulas on TIR expressions; here they run on Python ints,
so an off-by-one that would drop visible keys (wrong output) or walk needless tiles is
caught without a GPU.
"""

import itertools

import pytest

from tileops.kernels.attention.mask import (
    INT_OPS,
    key_tile_range,
    query_block_range,
    tile_fully_visible,
)

pytestmark = pytest.mark.smoke

WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (64, 0), (127, 0), (5, 7), (-1, 40), (200, -1)]
LENGTHS = [(1, 1), (17, 17), (130, 130), (1, 300), (300, 1), (100, 257), (257, 100)]


def visible(i, j, seq_q, seq_kv, left, right):
    rel = j - i - (seq_kv - seq_q)
    return (left < 0 or rel >= -left) and (right < 0 or rel <= right)


@pytest.mark.parametrize("left, right", WINDOWS)
@pytest.mark.parametrize("seq_q, seq_kv", LENGTHS)
@pytest.mark.parametrize("block_m, block_n", [(128, 128), (128, 64), (64, 176)])
def test_forward_walks_exactly_the_needed_key_tiles(seq_q, seq_kv, left, right, block_m,
                                                    block_n):
    for q_start in range(0, seq_q, block_m):
        rows = range(q_start, min(q_start + block_m, seq_q))
        needed = {j // block_n for i, j in itertools.product(rows, range(seq_kv))
                  if visible(i, j, seq_q, seq_kv, left, right)}
        begin, count = key_tile_range(q_start, seq_q, seq_kv, block_m, block_n, left, right,
                                      INT_OPS)
        walked = set(range(begin, begin + count))
        assert needed <= walked, (q_start, sorted(needed - walked))
        assert all(0 <= t < -(-seq_kv // block_n) for t in walked)
        # no more than one tile of slack on each side
        if needed:
            assert count <= max(needed) - min(needed) + 3


@pytest.mark.parametrize("left, right", WINDOWS)
@pytest.mark.parametrize("seq_q, seq_kv", LENGTHS)
@pytest.mark.parametrize("block_kv, block_q", [(128, 64), (128, 32)])
def test_backward_walks_every_query_block_that_sees_the_keys(seq_q, seq_kv, left, right,
                                                             block_kv, block_q):
    for kv_start in range(0, seq_kv, block_kv):
        keys = range(kv_start, min(kv_start + block_kv, seq_kv))
        needed = {i // block_q for i, j in itertools.product(range(seq_q), keys)
                  if visible(i, j, seq_q, seq_kv, left, right)}
        begin, count = query_block_range(kv_start, seq_q, seq_kv, block_kv, block_q, left,
                                         right, INT_OPS)
        walked = set(range(begin, begin + count))
        assert needed <= walked, (kv_start, sorted(needed - walked))
        assert all(0 <= t < -(-seq_q // block_q) for t in walked)


@pytest.mark.parametrize("left, right", WINDOWS)
@pytest.mark.parametrize("seq_q, seq_kv", LENGTHS + [(1000, 1000), (700, 1500)])
@pytest.mark.parametrize("block_m, block_n", [(128, 176), (64, 64)])
def test_a_tile_skips_its_mask_only_when_every_pair_is_visible(seq_q, seq_kv, left, right,
                                                               block_m, block_n):
    """Exact on blocks of real rows; a tail block may only err towards masking."""
    for q_start, kv_start in itertools.product(range(0, seq_q, block_m),
                                               range(0, seq_kv, block_n)):
        rows = range(q_start, q_start + block_m)
        keys = range(kv_start, kv_start + block_n)
        every_pair = all(j < seq_kv and visible(i, j, seq_q, seq_kv, left, right)
                         for i, j in itertools.product(rows, keys))
        full = tile_fully_visible(q_start, kv_start, seq_q, seq_kv, block_m, block_n, left,
                                  right)
        if q_start + block_m <= seq_q:
            assert full == every_pair, (q_start, kv_start)
        else:
            assert every_pair or not full, (q_start, kv_start)
