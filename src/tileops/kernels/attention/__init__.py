from .attention_fwd import AttentionFwdConfig, AttentionFwdKernel, AttentionVarlenFwdKernel

__all__ = ["AttentionFwdConfig", "AttentionFwdKernel", "AttentionVarlenFwdKernel"]
