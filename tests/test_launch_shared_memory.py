"""Kernel.compile refuses a program that asks for more dynamic shared memory than a CTA can
have on sm_90, naming the kernel and the config, instead of leaving the error to the first
launch (compiles a small program for sm_90a; no GPU)."""

from dataclasses import dataclass

import pytest
import tilelang.language as T

from tileops.kernels.base import Kernel
from tileops.kernels.launch_shared_memory import CTA_SHARED_LIMIT, launch_shared_bytes

pytestmark = pytest.mark.compile


@dataclass(frozen=True)
class StagingConfig:
    staged_bytes: int


class StagingKernel(Kernel):
    """Copies x through a shared buffer of `staged_bytes` (reads every element back out)."""

    name = "staging_probe"
    Config = StagingConfig

    def program(self, config, bucket):
        elements = config.staged_bytes // 4

        @T.prim_func
        def staging(x: T.Tensor((elements,), "float32"), y: T.Tensor((elements,), "float32")):
            with T.Kernel(1, threads=128):
                staged = T.alloc_shared((elements,), "float32")
                T.copy(x, staged)
                T.copy(staged, y)

        return staging


def test_compile_reads_the_launch_size_and_refuses_what_does_not_fit():
    kernel = StagingKernel()
    fits = StagingConfig(staged_bytes=CTA_SHARED_LIMIT - 4096)
    (compiled,) = kernel.compile(fits, "all")
    sizes = launch_shared_bytes(compiled.get_host_source())
    assert max(sizes.values()) >= fits.staged_bytes, sizes
    too_big = StagingConfig(staged_bytes=CTA_SHARED_LIMIT + 4096)
    with pytest.raises(ValueError, match=r"staging_probe: config .*staged_bytes=236544.* "
                                         r"needs \d+ bytes of dynamic shared memory"):
        kernel.compile(too_big, "all")


def test_a_launch_size_that_is_not_a_constant_is_left_alone():
    host = ("  (((TVMFFIAny*)stack_ffi_any)[2].v_int64) = ((int64_t)(n * 4));\n"
            "  if (TVMFFIFunctionCall(probe_kernel_packed, (TVMFFIAny*) stack_ffi_any, 3, &r)")
    assert launch_shared_bytes(host) == {}
    constant = host.replace("((int64_t)(n * 4))", "((int64_t)300000)")
    assert launch_shared_bytes(constant) == {"probe_kernel": 300000}
