from .cross_entropy import MODES, CrossEntropyKernel
from .softmax import KINDS, RowConfig, SoftmaxKernel

__all__ = ["KINDS", "MODES", "CrossEntropyKernel", "RowConfig", "SoftmaxKernel"]
