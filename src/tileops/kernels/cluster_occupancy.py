"""How many thread-block clusters of a shape a GPU holds at once, asked of the CUDA driver.

A persistent cluster kernel launches exactly as many clusters as are resident together and
strides its rows over them: one cluster more than fit waits for a second wave and doubles
the kernel's time, one fewer leaves its SMs idle. A cluster lives inside one GPC, so the
count depends on how the chip's SMs fall into GPCs, which differs between chips of the same
model (floor-swept parts): an H100 measured 39 clusters of 3 and 30 of 4 where a whole-GPC
bound gives 38 and 28. So the count is asked of the driver (cuOccupancyMaxActiveClusters)
once per device and shape, for a probe kernel made to hold `ctas_per_sm` CTAs an SM by its
shared memory, and passed to the kernels as a launch argument: the programs stay the same
on every chip and compile without a GPU.
"""

import ctypes
from typing import Any

# a kernel that does nothing; its shared memory and block size set the occupancy
_PROBE_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry tileops_cluster_probe()
{
    ret;
}
"""

SM_SHARED_BYTES = 228 * 1024  # Hopper: shared memory of one SM (a CTA reserves 1 KB more)
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("dims", ctypes.c_uint * 3), ("rest", ctypes.c_char * 52)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_driver: Any = None
_probes: dict[int, ctypes.c_void_p] = {}  # device index -> the probe's CUfunction
_counts: dict[tuple[int, int, int, int], int] = {}


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"tileops: {call} failed with CUDA driver error {status} while "
                           f"counting the resident clusters of a persistent cluster kernel")


def _probe(index: int) -> ctypes.c_void_p:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    if index not in _probes:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(_driver.cuModuleLoadData(ctypes.byref(module), _PROBE_PTX), "cuModuleLoadData")
        _check(_driver.cuModuleGetFunction(ctypes.byref(function), module,
                                           b"tileops_cluster_probe"), "cuModuleGetFunction")
        _check(_driver.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED,
                                          SM_SHARED_BYTES - 1024), "cuFuncSetAttribute")
        _probes[index] = function
    return _probes[index]


def probe_shared_bytes(ctas_per_sm: int) -> int:
    """Dynamic shared memory that lets exactly `ctas_per_sm` probe CTAs share an SM."""
    per_cta = SM_SHARED_BYTES // ctas_per_sm - 1024  # what k CTAs may each take
    below = SM_SHARED_BYTES // (ctas_per_sm + 1) - 1024  # what k + 1 could each take
    return (per_cta + below) // 2


def resident_clusters(device: Any, cluster: int, threads: int, ctas_per_sm: int) -> int:
    """Clusters of `cluster` CTAs of `threads` threads, `ctas_per_sm` CTAs an SM, that the
    device holds at once (read from the driver once per device and shape)."""
    fast = (device, cluster, threads, ctas_per_sm)  # per call: one dict lookup
    if fast in _counts:
        return _counts[fast]
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    key = (index, cluster, threads, ctas_per_sm)
    if key not in _counts:
        with torch.cuda.device(index):
            torch.cuda.init()  # the primary context, current on this thread
            function = _probe(index)
            attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
            attr.dims[:] = (cluster, 1, 1)
            config = _LaunchConfig(shared_bytes=probe_shared_bytes(ctas_per_sm),
                                   attrs=ctypes.pointer(attr), num_attrs=1)
            config.grid[:] = (cluster * 1024, 1, 1)
            config.block[:] = (threads, 1, 1)
            count = ctypes.c_int(0)
            _check(_driver.cuOccupancyMaxActiveClusters(ctypes.byref(count), function,
                                                        ctypes.byref(config)),
                   "cuOccupancyMaxActiveClusters")
        if count.value < 1:
            raise RuntimeError(f"tileops: no cluster of {cluster} CTAs of {threads} threads "
                               f"({ctas_per_sm} an SM) fits device {index}")
        _counts[key] = count.value
    if torch.device(device).index is not None:  # "cuda" alone may name another device later
        _counts[fast] = _counts[key]
    return _counts[key]
