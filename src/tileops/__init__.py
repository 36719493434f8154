"""TileOPs: spec-driven LLM operators on TileLang, tuned for NVIDIA Hopper."""

from .errors import (
    ManifestError,
    TileOpsError,
    TileOpsTypeError,
    TileOpsUnsupportedError,
    TileOpsValueError,
)
from .ops import (
    OP_CLASSES,
    GemmFwdOp,
    GroupedQueryAttentionBwdOp,
    GroupedQueryAttentionFwdOp,
    GroupedQueryAttentionVarlenFwdOp,
    Op,
    RMSNormFwdOp,
    attention,
    attention_varlen,
    gemm,
    rms_norm,
)
from .prebuild import warmup

__version__ = "0.1.0"

__all__ = [
    "GemmFwdOp", "RMSNormFwdOp", "GroupedQueryAttentionFwdOp",
    "GroupedQueryAttentionVarlenFwdOp", "GroupedQueryAttentionBwdOp", "Op", "OP_CLASSES",
    "attention", "attention_varlen", "gemm", "rms_norm", "warmup",
    "TileOpsError", "TileOpsTypeError", "TileOpsValueError", "TileOpsUnsupportedError",
    "ManifestError",
]
