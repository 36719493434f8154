"""Runs TileLang-generated CUDA on the CPU with one OS thread per CUDA thread, for kernels
whose threads do talk: shared memory, `__syncthreads()` and warp shuffles.

The blocks run one after another; the threads of a block run concurrently as host
threads, so a barrier is a real barrier (`__syncthreads` waits for the block, a shuffle
for its warp: each lane posts its value, the warp meets, each lane reads its partner's,
the warp meets again). Shared arrays become one static array, used by one block at a
time. So a kernel runs here as on the GPU provided every lane of a warp reaches each
shuffle (warp-uniform control flow around shuffles, which TileLang's code has) and it
uses no `__syncthreads_count` or async copies: anything outside that set fails to compile,
it is never silently emulated. The exception is the bulk TMA copy of a contiguous range into
shared memory with its mbarrier (`tl::tma_load(smem, gmem, barrier, bytes)`): the copy runs
when it is issued, and a barrier phase completes when its `count` threads have arrived (the
expected bytes are already there). Landing at issue is the earliest a copy can land, so a
landing that overwrites a slot some thread still reads shows up here; a read of a slot
before its barrier's wait does not. Atomic adds and loads (TileLang's `AtomicAddRet`,
`AtomicLoad`) run under one lock. Blocks run one after another (or a cluster's together),
so a protocol where the last block of a group to arrive merges the others' results runs
in the launch's arrival order, and one where a group's blocks wait for each other
(meeting_slices.py's exchange) must run each group as a "cluster" of concurrent blocks.
Arguments are bound as in `tests/cuda_emulation.py`, which handles kernels whose threads
never talk.

Thread-block clusters (`cluster` > 1): the blocks of a cluster run concurrently, each with
its own shared memory, barriers and shuffle slots; `map_shared_rank` points into a peer's
shared memory, and the cluster barrier waits for every thread of the cluster (an `arrive`
is a no-op and `wait` the whole barrier: stricter than the GPU, never weaker).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from . import cuda_emulation as emulation
from .cuda_emulation import _KERNEL, CUDA_HELPERS, build

_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <thread>
#include <vector>
#include <pthread.h>
#include <mutex>
#include <condition_variable>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <cutlass/numeric_types.h>
using cutlass::bfloat16_t;
using cutlass::half_t;
typedef unsigned int uint;
typedef unsigned char uchar;
struct EmuIndex { int x, y, z; };
static thread_local EmuIndex emu_thread, emu_block;
#define threadIdx emu_thread
#define blockIdx emu_block
#define CUDART_INF_F INFINITY
#define CUDART_NAN_F NAN
template <class A, class B> static inline auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> static inline auto max(A a, B b) { return a > b ? a : b; }
static inline unsigned __pack_nv_bfloat162(bfloat16_t x, bfloat16_t y) {
  return (unsigned(y.raw()) << 16) | unsigned(x.raw());
}
static inline unsigned __pack_half2(half_t x, half_t y) {
  return (unsigned(y.raw()) << 16) | unsigned(x.raw());
}
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
#define __align__(n) alignas(n)
#define EMU_MAX_CLUSTER 8
static int emu_cluster = 1;
static inline int emu_rank() { return emu_block.x % emu_cluster; }
static pthread_barrier_t emu_block_barrier[EMU_MAX_CLUSTER];
static pthread_barrier_t emu_cluster_barrier;
static pthread_barrier_t emu_warp_barrier[EMU_MAX_CLUSTER][64];
static uint64_t emu_lane_slot[EMU_MAX_CLUSTER][64][32];
static void emu_syncthreads() { pthread_barrier_wait(&emu_block_barrier[emu_rank()]); }
template <class V> static V emu_exchange(V v, int src_lane) {
  int warp = emu_thread.x / 32, lane = emu_thread.x % 32, rank = emu_rank();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  emu_lane_slot[rank][warp][lane] = bits;
  pthread_barrier_wait(&emu_warp_barrier[rank][warp]);
  bits = emu_lane_slot[rank][warp][src_lane];
  pthread_barrier_wait(&emu_warp_barrier[rank][warp]);
  V out;
  std::memcpy(&out, &bits, sizeof(V));
  return out;
}
static std::mutex emu_atomic_lock;
template <class T, class V> static T AtomicAddRet(T *address, V value, int = 0) {
  std::lock_guard<std::mutex> hold(emu_atomic_lock);
  T old = *address;
  *address = T(old + value);
  return old;
}
template <class T> static T AtomicLoad(T *address, int = 0) {
  std::this_thread::yield();  // a spinning reader lets the writers it waits for run
  std::lock_guard<std::mutex> hold(emu_atomic_lock);
  return *address;
}
template <class V> static V emu_shfl_xor(unsigned, V v, int m, int) {
  return emu_exchange(v, (emu_thread.x % 32) ^ m);
}
template <class V> static V emu_shfl_up(unsigned, V v, int d, int) {
  int lane = emu_thread.x % 32;
  V other = emu_exchange(v, lane >= d ? lane - d : lane);
  return lane >= d ? other : v;
}
template <class V> static V emu_shfl_down(unsigned, V v, int d, int) {
  int lane = emu_thread.x % 32;
  V other = emu_exchange(v, lane + d < 32 ? lane + d : lane);
  return lane + d < 32 ? other : v;
}
template <class V> static V emu_shfl(unsigned, V v, int src, int) {
  return emu_exchange(v, src % 32);
}
// TileLang's CTA-wide all-reduce (every thread of the block calls it): the `threads`
// threads spaced `scale` apart from `offset` that share this thread's group, combined in
// thread order (the GPU's butterfly order may round differently).
namespace tl {
struct SumOp { template <class T> static T apply(T a, T b) { return a + b; } };
struct MaxOp { template <class T> static T apply(T a, T b) { return a > b ? a : b; } };
struct MinOp { template <class T> static T apply(T a, T b) { return a < b ? a : b; } };
template <int N> struct NamedBarrier {};
// the approximate reciprocal (rcp.approx.ftz.f32 on the GPU), exact here
static inline float fast_rcp(float x) { return 1.0f / x; }
static double emu_reduce_slot[EMU_MAX_CLUSTER][2048];
template <class Op, int threads, int scale, int offset, class Barrier = void>
struct AllReduce {
  template <class T> static T run(T x, void * = nullptr) {
    int me = emu_thread.x - offset;
    double *slot = emu_reduce_slot[emu_rank()];
    slot[emu_thread.x] = double(x);
    emu_syncthreads();
    int base = (me / (scale * threads)) * scale * threads + me % scale;
    T acc = T(slot[base + offset]);
    for (int i = 1; i < threads; ++i)
      acc = Op::apply(acc, T(slot[base + offset + i * scale]));
    emu_syncthreads();
    return acc;
  }
};
// an mbarrier: a phase completes when `count` arrivals have come; wait(parity) returns once
// the phase of that parity has completed (the completed-phase count's parity differs)
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  int count = 0, pending = 0, phase = 0;
  void init(int n) { count = pending = n; phase = 0; }
  void expect_transaction(uint32_t) {}  // the copies land when issued
  void arrive() {
    std::lock_guard<std::mutex> hold(m);
    if (--pending == 0) { pending = count; phase ^= 1; cv.notify_all(); }
  }
  void wait(int parity) {
    std::unique_lock<std::mutex> hold(m);
    cv.wait(hold, [&] { return phase != parity; });
  }
};
template <int N> static inline bool tl_shuffle_elect() {
  return N == 0 ? emu_thread.x == 0 : emu_thread.x % N == 0;
}
static inline void fence_barrier_init() {}
static inline void fence_proxy_async() {}
static inline void tma_load(void *smem, const void *gmem, Barrier &, uint32_t bytes) {
  std::memcpy(smem, gmem, bytes);
}
// cp.async: the copy lands when issued, so commit and wait have nothing to do
template <int N> static inline void cp_async_gs(void *smem, const void *gmem) {
  std::memcpy(smem, gmem, N);
}
template <int N> static inline void cp_async_gs_conditional(void *smem, const void *gmem,
                                                            bool pred) {
  if (pred) std::memcpy(smem, gmem, N); else std::memset(smem, 0, N);
}
static inline void cp_async_commit() {}
template <int N> static inline void cp_async_wait() {}
static inline void cluster_arrive() {}
static inline void cluster_wait() { pthread_barrier_wait(&emu_cluster_barrier); }
static inline void cluster_sync() { pthread_barrier_wait(&emu_cluster_barrier); }
}  // namespace tl
"""
_DYNAMIC_SHARED = re.compile(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];")
# a static shared mbarrier array, one per block of a cluster (the struct is not 8 bytes here)
_BARRIERS = re.compile(r"__shared__ __align__\(16\) uint64_t (\w+)_mem\[(\d+)\];\s*"
                       r"auto (\w+) = reinterpret_cast<Barrier\*>\(\w+_mem\);")
_RENAMES = {"__syncthreads()": "emu_syncthreads()", "__shfl_xor_sync(": "emu_shfl_xor(",
            "__shfl_up_sync(": "emu_shfl_up(", "__shfl_down_sync(": "emu_shfl_down(",
            "__shfl_sync(": "emu_shfl("}
_DYNAMIC_SHARED_BYTES = 1 << 18
# each block of a cluster has its own dynamic shared memory; a peer's is found by offset
_CLUSTER_SHARED = r"""
static uchar *emu_shared_base[EMU_MAX_CLUSTER];
namespace cooperative_groups {
struct cluster_group {
  template <class T> T *map_shared_rank(T *p, int rank) {
    return (T *)(emu_shared_base[rank] + ((uchar *)p - emu_shared_base[emu_rank()]));
  }
};
static inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups
"""


def _library(source: str, threads: int, cluster: int = 1) -> tuple[Any, list[str]]:
    """The kernel compiled for the host with a `run_grid(grid, args...)` driver."""
    assert threads % 32 == 0 and threads <= 2048, threads
    assert 1 <= cluster <= 8, cluster
    start = source.index('extern "C" __global__ void __launch_bounds__')
    match = _KERNEL.match(source, start)
    name, params = match.group(1), match.group(2)
    names = [p.strip().split()[-1] for p in params.split(",")]
    body = source[start:].replace('extern "C" __global__ void', "static void", 1)
    body = _DYNAMIC_SHARED.sub(
        lambda m: f"alignas({m.group(1)}) static {m.group(2)} "
                  f"emu_{m.group(3)}[EMU_MAX_CLUSTER][{_DYNAMIC_SHARED_BYTES} / "
                  f"sizeof({m.group(2)})];\n  {m.group(2)} *{m.group(3)} = "
                  f"emu_{m.group(3)}[emu_rank()];\n  emu_shared_base[emu_rank()] = "
                  f"(uchar *){m.group(3)};", body)
    body = _BARRIERS.sub(
        lambda m: f"static tl::Barrier emu_{m.group(1)}[EMU_MAX_CLUSTER][{m.group(2)}];\n"
                  f"  tl::Barrier *{m.group(3)} = emu_{m.group(1)}[emu_rank()];", body)
    for old, new in _RENAMES.items():
        body = body.replace(old, new)
    # the driver's own names start with emu_: a kernel parameter may be called b or t
    driver = (f'extern "C" void run_grid(int grid, {params}) {{\n'
              f"  emu_cluster = {cluster};\n"
              f"  pthread_barrier_init(&emu_cluster_barrier, nullptr, {cluster * threads});\n"
              f"  for (int c = 0; c < {cluster}; ++c) {{\n"
              f"    pthread_barrier_init(&emu_block_barrier[c], nullptr, {threads});\n"
              f"    for (int w = 0; w < {threads // 32}; ++w)\n"
              f"      pthread_barrier_init(&emu_warp_barrier[c][w], nullptr, 32);\n  }}\n"
              f"  for (int emu_b = 0; emu_b < grid; emu_b += {cluster}) {{\n"
              f"    std::vector<std::thread> pool;\n"
              f"    for (int emu_t = 0; emu_t < {cluster * threads}; ++emu_t) "
              f"pool.emplace_back([=] {{\n"
              f"      emu_block.x = emu_b + emu_t / {threads}; emu_thread.x = emu_t % {threads};\n"
              f"      {name}({', '.join(names)});\n"
              f"    }});\n"
              f"    for (auto &th : pool) th.join();\n  }}\n}}\n")
    source = _PRELUDE + CUDA_HELPERS + _CLUSTER_SHARED + body + driver
    return build(source, "threads-", ["-O1"], ",-pthread"), [p.strip() for p in params.split(",")]


def run(compiled: Any, grid: int, threads: int, tensors: dict[str, Any],
        scalars: dict[str, Any], cluster: int = 1) -> None:
    """`cuda_emulation.run` with the blocks' threads running concurrently (see above), in
    clusters of `cluster` blocks (grid a multiple of it)."""
    assert grid % cluster == 0, (grid, cluster)
    emulation.run(compiled, grid, threads, tensors, scalars,
                  library=functools.partial(_library, cluster=cluster))
