#!/usr/bin/env bash
# The forward-norm compares of the fifty-fourth session (docs/performance/README.md): fused
# row sums on the tile map, the persistent lane map and LayerNorm's merged moments against
# each row's default, baseline torch eager. Extra arguments go to every call:
#   bash scripts/norm_forward_compares.sh --compile-only   # here: build the programs (sm_90a)
#   bash scripts/norm_forward_compares.sh                  # on the GPU machine: time them
# Configs name every field they set, so the H200 (tuned table) and an H100 (rules) time the
# same programs; "default" is whatever that GPU picks.
C="python3 scripts/compare_configs.py"
B="--baseline torch-eager"
f() { echo "{\"block_rows\": $1, \"threads\": $2, \"fused_sums\": true, \"lanes\": false}"; }
t() { echo "{\"block_rows\": $1, \"threads\": $2, \"lanes\": false}"; }
l() { echo "{\"block_rows\": $1, \"threads\": $2, \"lanes\": true, \"ctas\": $3}"; }
m() { echo "{\"block_rows\": $1, \"threads\": $2, \"lanes\": true, \"ctas\": $3, \"fused_sums\": true}"; }
$C LayerNormFwdOp --workload "falcon-40b prefill" $B --config "$(f 2 256)" --config "$(f 2 512)" --config "$(f 1 256)" "$@"
$C LayerNormFwdOp --workload "gpt-neox-20b" $B --config "$(m 1 256 0)" --config "$(m 1 256 264)" --config "$(l 1 256 264)" --config "$(l 1 256 528)" --config "$(l 1 256 1056)" --config "$(f 1 256)" --config "$(f 2 256)" "$@"
$C LayerNormFwdOp --workload "phi-2" $B --config "$(m 2 128 0)" --config "$(m 2 128 264)" --config "$(l 2 128 264)" --config "$(l 2 128 528)" --config "$(l 2 128 1056)" "$@"
$C RMSNormFwdOp --workload "llama3.1-8b prefill" $B --config "$(f 1 256)" --config "$(f 2 256)" --config "$(f 4 256)" --config "$(t 4 256)" --config "$(t 1 256)" "$@"
$C FusedAddRMSNormFwdOp --workload "llama3.1-8b prefill" $B --config "$(f 4 256)" --config "$(f 2 256)" --config "$(f 1 256)" "$@"
$C RMSNormFwdOp --workload "llama3.1-70b prefill" $B --config "$(f 2 512)" --config "$(f 2 256)" --config "$(f 1 256)" --config "$(t 2 512)" "$@"
$C FusedAddRMSNormFwdOp --workload "llama3.1-70b prefill" $B --config "$(f 2 256)" --config "$(f 2 512)" --config "$(f 1 256)" "$@"
$C RMSNormFwdOp --workload "deepseek-v3 prefill" $B --config "$(l 1 224 0)" --config "$(l 1 224 264)" --config "$(l 1 224 528)" --config "$(l 1 224 1056)" --config "$(f 1 128)" --config "$(t 1 128)" "$@"
$C FusedAddRMSNormFwdOp --workload "deepseek-v3 prefill" $B --config "$(l 1 224 264)" --config "$(l 1 224 528)" "$@"
$C LayerNormFwdOp --workload "vit-h-14" $B --config "$(l 4 128 264)" --config "$(l 4 128 528)" --config "$(l 4 128 1056)" "$@"
$C RMSNormFwdOp --workload "llama3.1-405b prefill" $B --config "$(f 1 512)" --config "$(f 1 256)" --config "$(t 1 512)" "$@"
$C RMSNormFwdOp --workload "=qwen3-32b prefill 8k tokens" $B --config "$(l 1 160 0)" --config "$(l 1 160 264)" --config "$(l 1 160 528)" --config "$(l 1 160 1056)" --config "$(f 1 128)" --config "$(t 1 128)" "$@"
