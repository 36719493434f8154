"""Op layer: one module per family."""

from .activation import (
    GegluBwdOp,
    GegluFwdOp,
    GeluAndMulBwdOp,
    GeluAndMulFwdOp,
    SiluAndMulBwdOp,
    SiluAndMulFwdOp,
    SwigluBwdOp,
    SwigluFwdOp,
    geglu,
    gelu_and_mul,
    silu_and_mul,
    swiglu,
)
from .attention import (
    GroupedQueryAttentionBwdOp,
    GroupedQueryAttentionFwdOp,
    GroupedQueryAttentionVarlenFwdOp,
    attention,
    attention_varlen,
)
from .base import Op
from .cross_entropy import (
    CrossEntropyBwdOp,
    CrossEntropyFwdOp,
    CrossEntropyWithGradFwdOp,
    cross_entropy,
)
from .decode_attention import (
    ChunkedPrefillAttentionFp8FwdOp,
    ChunkedPrefillAttentionFwdOp,
    DecodeAttentionFp8FwdOp,
    DecodeAttentionFwdOp,
    DecodePlan,
    KVCacheAppendFp8FwdOp,
    KVCacheAppendFwdOp,
    chunked_prefill_attention,
    decode_attention,
    kv_cache_append,
    plan_decode,
)
from .fp8 import GemmFp8FwdOp, QuantizeFp8FwdOp, gemm_fp8, quantize_fp8
from .fused_linear_cross_entropy import (
    FusedLinearCrossEntropyFwdOp,
    fused_linear_cross_entropy,
)
from .fused_moe import FusedMoeFwdOp, fused_moe
from .gemm import GemmFwdOp, gemm
from .grouped_gemm import (
    GroupedGemmBwdOp,
    GroupedGemmFwdOp,
    GroupedGemmSiluAndMulFwdOp,
    grouped_gemm,
    grouped_gemm_silu_and_mul,
)
from .grouped_gemm_fp8 import GroupedGemmFp8FwdOp, grouped_gemm_fp8
from .linear import LinearBwdOp, LinearFwdOp, linear
from .linear_group import LinearGroupFwdOp, linear_group
from .mla_decode import MLADecodeFwdOp, MLADecodePlan, mla_decode, plan_mla_decode
from .moe import (
    MoePermuteFwdOp,
    MoeRouteFwdOp,
    MoeUnpermuteBwdOp,
    MoeUnpermuteFwdOp,
    moe_permute,
    moe_route,
    moe_unpermute,
)
from .normalization import (
    FusedAddRMSNormBwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormBwdOp,
    LayerNormFwdOp,
    RMSNormBwdOp,
    RMSNormFwdOp,
    fused_add_rms_norm,
    fused_add_rms_norm_,
    layer_norm,
    rms_norm,
)
from .optimizer import AdamwStepFwdOp
from .position_encoding import (
    RotaryBwdOp,
    RotaryFwdOp,
    RotaryWithCacheFwdOp,
    apply_rotary,
    apply_rotary_with_cache,
)
from .rope_tables import (
    rope_cos_sin,
    rope_cos_sin_cache,
    rope_inv_freq,
    rope_inv_freq_from_config,
)
from .selection import ArgmaxFwdOp, TopkFwdOp, argmax, topk
from .softmax import (
    LogSoftmaxBwdOp,
    LogSoftmaxFwdOp,
    LogsumexpBwdOp,
    LogsumexpFwdOp,
    SoftmaxBwdOp,
    SoftmaxFwdOp,
    log_softmax,
    logsumexp,
    softmax,
)

OP_CLASSES: dict[str, type[Op]] = {
    cls.__name__: cls for cls in (GemmFwdOp, RMSNormFwdOp, GroupedQueryAttentionFwdOp,
                                  GroupedQueryAttentionVarlenFwdOp, GroupedQueryAttentionBwdOp,
                                  RMSNormBwdOp, FusedAddRMSNormFwdOp, FusedAddRMSNormBwdOp,
                                  LayerNormFwdOp, LayerNormBwdOp, SiluAndMulFwdOp,
                                  SiluAndMulBwdOp, GeluAndMulFwdOp, GeluAndMulBwdOp,
                                  SwigluFwdOp, SwigluBwdOp, GegluFwdOp, GegluBwdOp,
                                  RotaryFwdOp, RotaryBwdOp, RotaryWithCacheFwdOp,
                                  SoftmaxFwdOp, SoftmaxBwdOp, LogSoftmaxFwdOp, LogSoftmaxBwdOp,
                                  LogsumexpFwdOp, LogsumexpBwdOp, CrossEntropyFwdOp,
                                  CrossEntropyWithGradFwdOp, CrossEntropyBwdOp,
                                  FusedLinearCrossEntropyFwdOp, LinearFwdOp, LinearBwdOp,
                                  LinearGroupFwdOp, ArgmaxFwdOp, TopkFwdOp, DecodeAttentionFwdOp,
                                  KVCacheAppendFwdOp, ChunkedPrefillAttentionFwdOp,
                                  DecodeAttentionFp8FwdOp, ChunkedPrefillAttentionFp8FwdOp,
                                  KVCacheAppendFp8FwdOp, MLADecodeFwdOp,
                                  QuantizeFp8FwdOp, GemmFp8FwdOp, MoeRouteFwdOp,
                                  MoePermuteFwdOp, MoeUnpermuteFwdOp, GroupedGemmFwdOp,
                                  GroupedGemmBwdOp, GroupedGemmSiluAndMulFwdOp,
                                  MoeUnpermuteBwdOp, FusedMoeFwdOp, GroupedGemmFp8FwdOp,
                                  AdamwStepFwdOp)}

__all__ = ["Op", "OP_CLASSES", "GemmFwdOp", "RMSNormFwdOp", "GroupedQueryAttentionFwdOp",
           "GroupedQueryAttentionVarlenFwdOp", "GroupedQueryAttentionBwdOp", "attention",
           "attention_varlen", "gemm", "rms_norm", "RMSNormBwdOp", "FusedAddRMSNormFwdOp",
           "FusedAddRMSNormBwdOp", "LayerNormFwdOp", "LayerNormBwdOp", "fused_add_rms_norm",
           "fused_add_rms_norm_", "layer_norm", "SiluAndMulFwdOp", "SiluAndMulBwdOp",
           "GeluAndMulFwdOp", "GeluAndMulBwdOp", "SwigluFwdOp", "SwigluBwdOp", "silu_and_mul",
           "gelu_and_mul", "swiglu", "GegluFwdOp", "GegluBwdOp", "geglu",
           "RotaryFwdOp", "RotaryBwdOp", "RotaryWithCacheFwdOp", "apply_rotary",
           "apply_rotary_with_cache", "rope_inv_freq",
           "rope_inv_freq_from_config", "rope_cos_sin", "rope_cos_sin_cache",
           "SoftmaxFwdOp", "SoftmaxBwdOp", "LogSoftmaxFwdOp", "LogSoftmaxBwdOp", "LogsumexpFwdOp",
           "LogsumexpBwdOp", "softmax", "log_softmax", "logsumexp", "CrossEntropyFwdOp",
           "CrossEntropyWithGradFwdOp", "CrossEntropyBwdOp", "cross_entropy",
           "FusedLinearCrossEntropyFwdOp", "fused_linear_cross_entropy", "LinearFwdOp",
           "LinearBwdOp", "linear", "LinearGroupFwdOp", "linear_group",
           "ArgmaxFwdOp", "TopkFwdOp", "argmax", "topk",
           "DecodeAttentionFwdOp", "KVCacheAppendFwdOp", "decode_attention", "kv_cache_append",
           "ChunkedPrefillAttentionFwdOp", "chunked_prefill_attention", "DecodePlan", "plan_decode",
           "DecodeAttentionFp8FwdOp", "ChunkedPrefillAttentionFp8FwdOp", "KVCacheAppendFp8FwdOp",
           "MLADecodeFwdOp", "mla_decode", "MLADecodePlan", "plan_mla_decode",
           "QuantizeFp8FwdOp", "GemmFp8FwdOp", "quantize_fp8", "gemm_fp8",
           "MoeRouteFwdOp", "MoePermuteFwdOp", "MoeUnpermuteFwdOp", "moe_route", "moe_permute",
           "moe_unpermute", "GroupedGemmFwdOp", "grouped_gemm", "GroupedGemmBwdOp",
           "GroupedGemmSiluAndMulFwdOp", "grouped_gemm_silu_and_mul", "MoeUnpermuteBwdOp",
           "FusedMoeFwdOp", "fused_moe", "GroupedGemmFp8FwdOp", "grouped_gemm_fp8",
           "AdamwStepFwdOp"]
