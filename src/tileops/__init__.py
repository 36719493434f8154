"""TileOPs: spec-driven LLM operators on TileLang, tuned for NVIDIA Hopper.

The public API is the op layer (`tileops.ops.__all__`: Op classes such as `GemmFwdOp`,
functionals such as `tileops.gemm`, `OP_CLASSES`), `warmup`, `list_ops` and the error
types. The op layer, and with it torch and TileLang (seconds of start-up), loads on the
first lookup of one of its names, so `import tileops`, `tileops.list_ops()` and the
`tileops` command's manifest-only subcommands start fast. The `torch.ops.tileops.<name>`
custom ops are registered when the op layer loads: on that first lookup, or by
`import tileops.ops`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .errors import ManifestError as ManifestError
from .errors import TileOpsError as TileOpsError
from .errors import TileOpsTypeError as TileOpsTypeError
from .errors import TileOpsUnsupportedError as TileOpsUnsupportedError
from .errors import TileOpsValueError as TileOpsValueError

__version__ = "0.1.0"

_ERRORS = ["TileOpsError", "TileOpsTypeError", "TileOpsValueError", "TileOpsUnsupportedError",
           "ManifestError"]
# names that load without the op layer: public name -> the submodule that defines it
_LIGHT = {"warmup": ".prebuild", "list_ops": ".manifest", "OpInfo": ".manifest"}


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return [*_op_layer().__all__, *_LIGHT, *_ERRORS]
    if name.startswith("__"):  # introspection (copy, pickle, inspect) must not load torch
        raise AttributeError(f"module 'tileops' has no attribute {name!r}")
    if name in _LIGHT:
        value = getattr(importlib.import_module(_LIGHT[name], __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a submodule: tileops.cli
    else:
        ops = _op_layer()
        if name not in ops.__all__:
            raise AttributeError(f"module 'tileops' has no attribute {name!r}")
        value = getattr(ops, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))


def _op_layer() -> Any:
    return importlib.import_module(".ops", __name__)
