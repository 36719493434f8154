"""L2 eviction hints on 16-byte global loads and stores, for kernels that read data twice.

A two-pass row kernel (softmax over a 128K-column vocabulary row) reads each row once for
its statistics and again for its outputs. With 132 SMs streaming their rows, the L2 (50 MB)
is swept by the outputs and by every other row before the second read comes back, so that
read goes to HBM: three transfers an element where two would do. The hints bias what the L2
keeps: the first read marks its lines evict-last (keep), the second read evict-first (no
longer needed), and the outputs evict-first (written once, never read here), so the L2
holds the rows in flight between their two reads.

TileLang has no load with a cache policy, so these are small CUDA functions (PTX
`createpolicy` and `ld/st.global.L2::cache_hint`) imported into the kernel's source with
`T.import_source` (cuda_helpers: with the other helpers, one text a kernel) and called with
`T.call_extern`. Each moves 16 bytes between global memory
and a local array slot that the caller addresses; the caller unpacks or packs the values.
"""

import tilelang.language as T

from . import cuda_helpers

CUDA_SOURCE = r"""
namespace tileops_l2 {
__device__ __forceinline__ unsigned long long keep_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ unsigned long long drop_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ void load16(void* dst, const void* src, unsigned long long p) {
  uint4 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "l"(p));
  *reinterpret_cast<uint4*>(dst) = v;
}
__device__ __forceinline__ void store16(void* dst, const void* src, unsigned long long p) {
  uint4 v = *reinterpret_cast<const uint4*>(src);
  asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;"
               :: "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(p) : "memory");
}
}  // namespace tileops_l2
"""

VECTOR_BYTES = 16


def import_hints():
    """Call inside a T.Kernel body that uses the functions below."""
    cuda_helpers.import_source()


def keep_policy():
    """A uint64 cache policy: lines loaded with it are evicted last."""
    return T.call_extern("uint64", "tileops_l2::keep_policy")


def drop_policy():
    """A uint64 cache policy: lines accessed with it are evicted first."""
    return T.call_extern("uint64", "tileops_l2::drop_policy")


def load16(dst_slot, src_element, policy):
    """16 bytes at global `src_element` (a buffer element) -> local `dst_slot` onwards."""
    return T.call_extern("handle", "tileops_l2::load16", T.address_of(dst_slot),
                         T.address_of(src_element), policy)


def store16(dst_element, src_slot, policy):
    """16 bytes of local `src_slot` onwards -> global `dst_element` (a buffer element)."""
    return T.call_extern("handle", "tileops_l2::store16", T.address_of(dst_element),
                         T.address_of(src_slot), policy)
