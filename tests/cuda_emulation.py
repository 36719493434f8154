"""Runs the CUDA that TileLang generated for a kernel on the CPU, thread after thread.

For kernels whose threads never talk to each other (no shared memory, barriers, warp
shuffles or atomics: element-wise and gather kernels), running every (block, thread) pair
in turn computes exactly what the GPU computes, so the generated code's indexing, guards,
vector accesses and math can be checked on a machine without a GPU. The kernel body is
compiled by nvcc as a host function; TileLang's half/bfloat16 types are CUTLASS's, which
work on the host. Arguments are bound as the generated host wrapper binds them (its launch
packing names each kernel argument: a buffer, a tensor's stride, or a scalar).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import subprocess
import tempfile
from typing import Any

_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vector_types.h>
#include <cutlass/numeric_types.h>
using cutlass::bfloat16_t;
using cutlass::half_t;
struct EmuIndex { int x, y, z; };
static EmuIndex emu_thread, emu_block;
#define threadIdx emu_thread
#define blockIdx emu_block
template <class A, class B> static inline auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> static inline auto max(A a, B b) { return a > b ? a : b; }
#define __launch_bounds__(...)
#define __restrict__
// the zero fill of a guarded 16-byte load (TileLang's common.h, on the device)
static inline unsigned __pack_nv_bfloat162(bfloat16_t x, bfloat16_t y) {
  return (unsigned(y.raw()) << 16) | unsigned(x.raw());
}
static inline unsigned __pack_half2(half_t x, half_t y) {
  return (unsigned(y.raw()) << 16) | unsigned(x.raw());
}
// TileLang's fp8 names and clamp (tl_templates/cuda/cuda_fp8.h, math.h): the fp8 cache
// kernels store through them; cuda_fp8.h's conversions run on the host too
#include <cuda_fp8.h>
typedef __nv_fp8_e4m3 fp8_e4_t;
struct alignas(4) fp8_e4_4_t { fp8_e4_t x, y, z, w; };
namespace tl {
static inline float clamp(float x, float lo, float hi) {
  return x != x ? x : fminf(fmaxf(x, lo), hi);
}
// the SFU's approximate reciprocal (rcp.approx): the exact quotient here
static inline float fast_rcp(float x) { return 1.0f / x; }
}  // namespace tl
"""
# kernels/cuda_helpers.py's functions on the host: l2_hints' 16-byte loads and stores, whose
# L2 eviction hint has no meaning here (the policies are opaque numbers), and fast_math's
# SFU 2^x as exp2f
CUDA_HELPERS = r"""
namespace tileops_l2 {
static inline unsigned long long keep_policy() { return 1; }
static inline unsigned long long drop_policy() { return 2; }
static inline void load16(void *dst, const void *src, unsigned long long) {
  std::memcpy(dst, src, 16);
}
static inline void store16(void *dst, const void *src, unsigned long long) {
  std::memcpy(dst, src, 16);
}
}  // namespace tileops_l2
namespace tileops_math {
static inline float ex2(float x) { return exp2f(x); }
}  // namespace tileops_math
"""
_KERNEL = re.compile(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\((.*?)\) \{',
                     re.S)
_BUILD_DIR = pathlib.Path(tempfile.gettempdir()) / "tileops-cuda-emulation"


def build(code: str, tag: str, flags: list[str], host_flags: str = "") -> Any:
    """`run_grid` of `code` compiled by nvcc as a host library (cached by its text)."""
    digest = hashlib.sha1(code.encode()).hexdigest()[:20]
    _BUILD_DIR.mkdir(exist_ok=True)
    lib = _BUILD_DIR / f"{tag}{digest}.so"
    if not lib.exists():
        import tilelang

        cutlass = pathlib.Path(tilelang.__file__).parent / "3rdparty" / "cutlass" / "include"
        src = _BUILD_DIR / f"{tag}{digest}.cu"
        src.write_text(code)
        tmp = _BUILD_DIR / f"{tag}{digest}.{os.getpid()}.so"
        subprocess.run(["nvcc", *flags, "-w", "-std=c++17", "-shared", "-Xcompiler",
                        f"-fPIC,-fno-strict-aliasing{host_flags}", f"-I{cutlass}", "-o",
                        str(tmp), str(src)], check=True, capture_output=True)
        tmp.rename(lib)
    return ctypes.CDLL(str(lib)).run_grid


def _library(source: str, threads: int) -> tuple[Any, list[str]]:
    """The kernel compiled for the host with a `run_grid(grid, args...)` driver."""
    start = source.index('extern "C" __global__ void __launch_bounds__')
    match = _KERNEL.match(source, start)
    name, params = match.group(1), match.group(2)
    param_list = [p.strip() for p in params.split(",")]
    names = [p.split()[-1] for p in param_list]
    body = source[start:].replace('extern "C" __global__ void', "static void", 1)
    driver = (f'extern "C" void run_grid(int grid, {params}) {{\n'
              f"  for (int b = 0; b < grid; ++b) for (int t = 0; t < {threads}; ++t) {{\n"
              f"    emu_block.x = b; emu_thread.x = t; {name}({', '.join(names)});\n  }}\n}}\n")
    # -O0 and no strict aliasing: the generated code type-puns vectors through pointers
    return build(_PRELUDE + CUDA_HELPERS + body + driver, "", ["-O0"]), param_list


def _launch_arguments(host: str, func: str) -> list[tuple]:
    """('buffer', name) | ('stride', buffer, dim) | ('scalar', name) per kernel argument."""
    strides, pending = {}, {}
    for line in host.splitlines():
        m = re.search(rf"(condval\w*) = \(\(int64_t\*\){func}_(\w+)_strides\)\[(\d+)\];", line)
        if m:
            pending[m.group(1)] = (m.group(2), int(m.group(3)))
        m = re.search(r"int64_t (stride\w*) = (condval\w*);", line)
        if m and m.group(2) in pending:
            strides[m.group(1)] = pending[m.group(2)]
    first = host.rindex("[0].v_ptr)")
    packing = host[host.rindex("\n", 0, first):]
    args: dict[int, tuple] = {}
    for m in re.finditer(r"stack_ffi_any\)\[(\d+)\]\.(v_ptr|v_int64)\) = ([^;]+);", packing):
        i, kind, expr = int(m.group(1)), m.group(2), m.group(3).strip()
        if kind == "v_ptr":
            args[i] = ("buffer", expr)
        elif expr in strides:
            args[i] = ("stride", *strides[expr])
        elif i not in args:
            args[i] = ("scalar", re.sub(r"\(\(int64_t\)(\w+)\)", r"\1", expr))
    return [args[i] for i in sorted(args)]


def run(compiled: Any, grid: int, threads: int, tensors: dict[str, Any],
        scalars: dict[str, Any], library: Any = None) -> None:
    """Runs `compiled` (a TileLang JITKernel) on CPU tensors: `tensors` by parameter name
    (TileLang's names: `cos` may appear as `cos_1`), `scalars` by name (symbolic sizes, and
    scalar parameters such as a float scale). `library` builds the host program (this
    module's thread-after-thread one by default)."""
    source = compiled.get_kernel_source()
    func = re.search(r"void __launch_bounds__\([^)]*\) (\w+)_kernel\(", source).group(1)
    fn, params = (library or _library)(source, threads)
    values = []
    # a float scalar is packed as v_float64: spelled as an int64 one, the parser names it
    # like the others (the value is converted by the kernel parameter's type)
    host = re.sub(r"\.v_float64\) = \(\(double\)(\w+)\);", r".v_int64) = ((int64_t)\1);",
                  compiled.get_host_source())
    # the launch packing ends with the grid and block sizes, after the kernel's arguments
    arguments = _launch_arguments(host, func)[:len(params)]
    for param, arg in zip(params, arguments, strict=True):
        if arg[0] == "buffer":
            name = arg[1] if arg[1] in tensors else re.sub(r"_\d+$", "", arg[1])
            values.append(ctypes.c_void_p(tensors[name].data_ptr()))
        elif arg[0] == "stride":
            values.append(ctypes.c_int64(tensors[arg[1]].stride(arg[2])))
        else:
            convert = {"int64_t": ctypes.c_int64, "float": ctypes.c_float,
                       "double": ctypes.c_double}.get(param.split()[-2], ctypes.c_int)
            values.append(convert(scalars[arg[1]]))
    fn(ctypes.c_int(grid), *values)
