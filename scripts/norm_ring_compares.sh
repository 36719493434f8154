#!/usr/bin/env bash
# The norm compares of the fifty-fifth session (docs/performance/README.md): the lane map's
# shared cp.async ring (`stages` with `lanes`; forward: with a persistent grid) against each
# row's default, baseline torch eager; backward first. Extra arguments go to every call:
#   bash scripts/norm_ring_compares.sh --compile-only   # here: build the programs (sm_90a)
#   bash scripts/norm_ring_compares.sh                  # on the GPU machine: time them
# Configs name every field, so every GPU times the same programs; "default" is its own pick.
C="python3 scripts/compare_configs.py"
B="--baseline torch-eager"
r() { echo "{\"block_rows\": $1, \"threads\": $2, \"ctas\": $3, \"stages\": $4, \"lanes\": true, \"prefetch\": false, \"fused_sums\": false, \"from_shared\": false, \"acc_shared\": ${5:-false}, \"dynamic\": false}"; }
$C LayerNormBwdOp --workload "vit-h-14" $B --config "$(r 4 128 264 2)" --config "$(r 4 128 264 3)" --config "$(r 4 128 264 4)" --config "$(r 4 128 396 3)" --config "$(r 4 128 528 2 true)" "$@"
$C LayerNormBwdOp --workload "gpt-neox-20b" $B --config "$(r 1 256 132 3)" --config "$(r 1 256 264 2)" --config "$(r 1 256 264 3)" "$@"
$C RMSNormBwdOp --workload "llama3.1-8b" --dtype bfloat16 $B --config "$(r 1 128 264 3)" --config "$(r 1 128 528 2)" --config "$(r 1 128 528 3)" --config "$(r 1 256 264 3)" "$@"
$C FusedAddRMSNormBwdOp --workload "llama3.1-8b" --dtype bfloat16 $B --config "$(r 1 128 264 3)" --config "$(r 1 128 528 2)" "$@"
$C RMSNormBwdOp --workload "405b" $B --config "$(r 1 512 132 2)" --config "$(r 1 512 132 3)" "$@"
$C LayerNormBwdOp --workload "falcon-40b" --dtype bfloat16 $B --config "$(r 1 256 264 2)" --config "$(r 1 256 132 3)" "$@"
f() { echo "{\"block_rows\": $1, \"threads\": $2, \"ctas\": $3, \"stages\": $4, \"lanes\": true, \"prefetch\": false, \"fused_sums\": false}"; }
$C LayerNormFwdOp --workload "vit-h-14" $B --config "$(f 4 128 264 3)" --config "$(f 4 128 528 2)" --config "$(f 4 128 528 3)" "$@"
$C LayerNormFwdOp --workload "phi-2" $B --config "$(f 2 128 264 3)" --config "$(f 2 128 528 2)" --config "$(f 2 128 528 3)" "$@"
$C LayerNormFwdOp --workload "gpt-neox-20b" $B --config "$(f 1 256 264 3)" --config "$(f 1 256 528 2)" "$@"
$C RMSNormFwdOp --workload "deepseek-v3 prefill" $B --config "$(f 1 224 264 3)" --config "$(f 1 224 528 2)" "$@"
$C RMSNormFwdOp --workload "=qwen3-32b prefill 8k tokens" $B --config "$(f 1 160 528 3)" --config "$(f 1 160 528 2)" "$@"
$C FusedAddRMSNormFwdOp --workload "deepseek-v3 prefill" $B --config "$(f 1 224 264 3)" --config "$(f 1 224 528 2)" "$@"
