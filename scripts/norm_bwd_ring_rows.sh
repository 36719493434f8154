#!/usr/bin/env bash
# The fifty-seventh session's compares: the norm backward's lane-map ring (rows dealt statically, a shared cp.async ring of 2-3
# steps) against each row's default on every RMSNorm / fused-add / LayerNorm backward row of
# 4096-8192 columns; baseline torch eager. Extra arguments go to every call:
#   bash scripts/norm_bwd_ring_rows.sh --compile-only   # here: build the programs (sm_90a)
#   bash scripts/norm_bwd_ring_rows.sh                  # on the GPU machine: time them
# Configs name every field, so every GPU times the same programs; "default" is its own pick.
C="python3 scripts/compare_configs.py"
B="--baseline torch-eager --dtype bfloat16"
r() { echo "{\"block_rows\": 1, \"threads\": $1, \"ctas\": $2, \"stages\": $3, \"dynamic\": false, \"lanes\": true, \"prefetch\": false, \"fused_sums\": false, \"from_shared\": false, \"acc_shared\": false}"; }
$C RMSNormBwdOp --workload "llama3.1-8b" $B --config "$(r 256 132 3)" --config "$(r 512 132 3)" --config "$(r 128 264 3)" "$@"
$C RMSNormBwdOp --workload "llama3.1-70b" $B --config "$(r 256 132 3)" --config "$(r 512 132 3)" --config "$(r 256 132 2)" "$@"
$C RMSNormBwdOp --workload "deepseek-v3" $B --config "$(r 448 132 3)" --config "$(r 448 132 2)" "$@"
$C RMSNormBwdOp --workload "qwen3-32b" $B --config "$(r 320 132 3)" --config "$(r 160 264 3)" --config "$(r 320 264 2)" "$@"
$C FusedAddRMSNormBwdOp --workload "llama3.1-8b" $B --config "$(r 128 264 3)" --config "$(r 256 132 3)" "$@"
$C FusedAddRMSNormBwdOp --workload "llama3.1-70b" $B --config "$(r 256 132 3)" --config "$(r 512 132 2)" "$@"
$C FusedAddRMSNormBwdOp --workload "qwen3-32b" $B --config "$(r 320 132 3)" --config "$(r 160 264 3)" "$@"
$C LayerNormBwdOp --workload "falcon-40b" $B --config "$(r 256 132 3)" --config "$(r 512 132 2)" "$@"
$C LayerNormBwdOp --workload "gpt-neox-20b" $B --config "$(r 384 132 3)" --config "$(r 256 132 3)" "$@"
