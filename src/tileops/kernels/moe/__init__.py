from .combine import CombineConfig, MoeCombineKernel, MoeCombineWeightGradKernel
from .grouped_gemm import GroupedGemmConfig, GroupedGemmKernel, GroupedGemmWeightGradKernel
from .permute import CHUNK, GatherConfig, MoeGatherKernel, MoeSortKernel
from .routing import MAX_EXPERTS, MAX_TOP_K, MoeRouteKernel, RouteConfig

__all__ = ["CHUNK", "CombineConfig", "GatherConfig", "GroupedGemmConfig", "GroupedGemmKernel",
           "GroupedGemmWeightGradKernel", "MAX_EXPERTS", "MAX_TOP_K", "MoeCombineKernel",
           "MoeCombineWeightGradKernel", "MoeGatherKernel", "MoeRouteKernel", "MoeSortKernel",
           "RouteConfig"]
