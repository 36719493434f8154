"""The dynamic shared memory a compiled program asks for at launch, checked at compile time.

TileLang 0.1.15 sizes a kernel's dynamic shared memory after its own buffer reuse, which a
config's arithmetic cannot always predict (a loop that keeps every buffer live, as the
grouped weight gradient's expert loop does, disables the reuse), and compiles a kernel
that asks for more than an SM can give without a word: the error only comes at the first
launch, from the CUDA driver, as "Failed to set the allowed dynamic shared memory size".
The host code TileLang generates passes the size as the last argument of each kernel's
packed call; reading it there lets `Kernel.compile` refuse such a config on any machine,
GPU or not, naming the kernel and the config.
"""

from __future__ import annotations

import re
from typing import Any

# the most dynamic shared memory a CTA may opt into on sm_90 (the SM's 228 KB less 1 KB the
# CTA reserves)
CTA_SHARED_LIMIT = 227 * 1024

_PACKED_CALL = re.compile(r"TVMFFIFunctionCall\((\w+)_packed, \(TVMFFIAny\*\) stack_ffi_any, "
                          r"(\d+),")


def launch_shared_bytes(host_source: str) -> dict[str, int]:
    """{kernel: bytes} for every kernel launch in `host_source` whose size is a constant
    (the packed call's last argument: grid, block, then the dynamic shared memory)."""
    sizes = {}
    for call in _PACKED_CALL.finditer(host_source):
        last = int(call.group(2)) - 1
        before = host_source[:call.start()]
        assigned = re.findall(rf"stack_ffi_any\)\[{last}\]\.v_int64\) = (.*?);\n", before)
        constant = re.fullmatch(r"\(\(int64_t\)(\d+)\)", assigned[-1]) if assigned else None
        if constant is not None:
            sizes[call.group(1)] = max(sizes.get(call.group(1), 0), int(constant.group(1)))
    return sizes


def check_launch_shared_memory(kernel_name: str, config: Any, compiled: Any) -> None:
    """Raises ValueError when a program of `compiled` asks for more than a CTA can get."""
    for function, size in launch_shared_bytes(compiled.get_host_source()).items():
        if size > CTA_SHARED_LIMIT:
            raise ValueError(
                f"{kernel_name}: config {config} needs {size} bytes of dynamic shared memory "
                f"in {function}, more than the {CTA_SHARED_LIMIT} a CTA can have on sm_90")
