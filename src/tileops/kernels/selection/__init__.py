from .argmax import ArgmaxConfig, ArgmaxKernel
from .topk import K_CAPS, MAX_K, TopkConfig, TopkKernel, k_cap_of

__all__ = ["ArgmaxConfig", "ArgmaxKernel", "K_CAPS", "MAX_K", "TopkConfig", "TopkKernel",
           "k_cap_of"]
