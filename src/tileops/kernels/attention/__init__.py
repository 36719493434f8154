from .attention_fwd import AttentionFwdConfig, AttentionFwdKernel

__all__ = ["AttentionFwdConfig", "AttentionFwdKernel"]
