"""Op layer: one module per family."""

from .attention import (
    GroupedQueryAttentionBwdOp,
    GroupedQueryAttentionFwdOp,
    GroupedQueryAttentionVarlenFwdOp,
    attention,
    attention_varlen,
)
from .base import Op
from .gemm import GemmFwdOp, gemm
from .normalization import RMSNormFwdOp, rms_norm

OP_CLASSES: dict[str, type[Op]] = {
    cls.__name__: cls for cls in (GemmFwdOp, RMSNormFwdOp, GroupedQueryAttentionFwdOp,
                                  GroupedQueryAttentionVarlenFwdOp, GroupedQueryAttentionBwdOp)}

__all__ = ["Op", "OP_CLASSES", "GemmFwdOp", "RMSNormFwdOp", "GroupedQueryAttentionFwdOp",
           "GroupedQueryAttentionVarlenFwdOp", "GroupedQueryAttentionBwdOp", "attention",
           "attention_varlen", "gemm", "rms_norm"]
