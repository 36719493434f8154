"""GPU profiles: peak rates used for speed-of-light (SOL) numbers."""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass

import yaml

from ..errors import TileOpsUnsupportedError
from ..kernels.base import gpu_slug

PROFILE_DIR = pathlib.Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class GpuProfile:
    name: str
    bytes_per_s: float
    flops_per_s: dict[str, float]
    l2_bytes: int

    def sol_seconds(self, flops: int, nbytes: int, dtype: str) -> tuple[float, str]:
        """Speed-of-light time and what bounds it ('compute' or 'memory')."""
        t_compute = flops / self.flops_per_s.get(dtype, self.flops_per_s["float16"])
        t_memory = nbytes / self.bytes_per_s
        return (t_compute, "compute") if t_compute >= t_memory else (t_memory, "memory")


@functools.cache
def load_profile(device_name: str) -> GpuProfile:
    """The profile of a GPU by its name ('NVIDIA H200'); measured ceilings where known."""
    path = PROFILE_DIR / f"{gpu_slug(device_name)}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise TileOpsUnsupportedError(
            f"no GPU profile for '{device_name}' (looked for {path.name}; known: {known})")
    data = yaml.safe_load(path.read_text())
    peak = {**data["datasheet"]["tflops"], **data.get("measured", {}).get("tflops", {})}
    bw = data.get("measured", {}).get("hbm_bytes_per_s", data["datasheet"]["hbm_bytes_per_s"])
    return GpuProfile(data["name"], float(bw), {k: v * 1e12 for k, v in peak.items()},
                      int(data["l2_bytes"]))
