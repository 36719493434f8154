#!/usr/bin/env bash
# The norm backward compares of the fifty-sixth session (docs/performance/README.md): the
# lane map's ring with its rows dealt as the CTAs go (`dynamic`) against the same ring dealt
# statically and each row's default; baseline torch eager. Extra arguments go to every call:
#   bash scripts/norm_dynamic_compares.sh --compile-only   # here: build the programs (sm_90a)
#   bash scripts/norm_dynamic_compares.sh                  # on the GPU machine: time them
# Configs name every field, so every GPU times the same programs; "default" is its own pick.
C="python3 scripts/compare_configs.py"
B="--baseline torch-eager"
d() { echo "{\"block_rows\": $1, \"threads\": $2, \"ctas\": $3, \"stages\": $4, \"dynamic\": $5, \"lanes\": true, \"prefetch\": false, \"fused_sums\": false, \"from_shared\": false, \"acc_shared\": false}"; }
$C RMSNormBwdOp --workload "llama3.1-8b" --dtype bfloat16 $B --config "$(d 1 256 132 3 false)" --config "$(d 1 256 132 3 true)" --config "$(d 1 256 132 2 true)" --config "$(d 1 128 264 3 true)" "$@"
$C LayerNormBwdOp --workload "gpt-neox-20b" $B --config "$(d 1 384 132 3 false)" --config "$(d 1 384 132 3 true)" --config "$(d 1 256 132 3 true)" "$@"
$C LayerNormBwdOp --workload "vit-h-14" $B --config "$(d 8 256 132 3 false)" --config "$(d 8 256 132 3 true)" --config "$(d 4 128 264 3 true)" --config "$(d 4 128 264 2 true)" "$@"
$C FusedAddRMSNormBwdOp --workload "llama3.1-8b" --dtype bfloat16 $B --config "$(d 1 128 264 3 false)" --config "$(d 1 128 264 3 true)" --config "$(d 1 256 132 3 true)" "$@"
$C RMSNormBwdOp --workload "405b" $B --config "$(d 1 512 132 2 false)" --config "$(d 1 512 132 2 true)" "$@"
$C LayerNormBwdOp --workload "falcon-40b" --dtype bfloat16 $B --config "$(d 1 256 132 3 false)" --config "$(d 1 256 132 3 true)" "$@"
$C RMSNormBwdOp --workload "llama3.1-70b" --dtype bfloat16 $B --config "$(d 1 256 132 3 true)" --config "$(d 1 512 132 3 true)" "$@"
