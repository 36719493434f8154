"""Op layer: one module per family."""

from .attention import GroupedQueryAttentionFwdOp, attention
from .base import Op
from .gemm import GemmFwdOp, gemm
from .normalization import RMSNormFwdOp, rms_norm

OP_CLASSES: dict[str, type[Op]] = {
    cls.__name__: cls for cls in (GemmFwdOp, RMSNormFwdOp, GroupedQueryAttentionFwdOp)}

__all__ = ["Op", "OP_CLASSES", "GemmFwdOp", "RMSNormFwdOp", "GroupedQueryAttentionFwdOp",
           "attention", "gemm", "rms_norm"]
