#!/usr/bin/env bash
# The MLA decode schedule's fitted split rules (`MLADecodeConfig.fit_waves`) and the combine
# in 128-column chunks (`combine_cols`), both of the sixty-third session (built without a
# device), against each DeepSeek-V3 row's default, the op's configs alone. Batch 1 takes no
# fitted rule (one request keeps the unfitted one) but the most from the combine. Extra
# arguments go to every call:
#   bash scripts/mla_fit_compares.sh --compile-only          # here: into .tilecache
#   bash .gpu/remote.sh bash scripts/mla_fit_compares.sh     # on the GPU machine
# Each compare goes through gpu_session.sh (its wheels, .tilecache, $OUT/compare.log).
# The seesaw rows (batch >= 32 at 4K, 16 at 8K) compare it on pair runs, where the default
# runs; the fitted schedule changes only which slots the same programs run.
C="bash scripts/gpu_session.sh compare MLADecodeFwdOp --dtype bfloat16 --baseline none"
s() { echo "{\"seesaw\": true, \"pair_runs\": true, \"fit_waves\": $1$2}"; }
p() { echo "{\"seesaw\": false, \"block_n\": 64, \"stages\": 2, $1}"; }
for row in "batch 1 x 4k" "batch 1 x 32k"; do
  $C --workload "$row" --config "$(p '"combine_cols": 128')" "$@"
done
for row in "tp8 (16 heads)" "tp4 (32 heads)"; do  # the plain program: H < 128
  $C --workload "$row" --config "$(p '"fit_waves": 4')" \
    --config "$(p '"fit_waves": 4, "combine_cols": 128')" "$@"
done
for row in "batch 32 x 4k" "batch 32 x 8k" "batch 32 x 32k" "batch 48 x 4k" "batch 80 x 8k" \
           "batch 128 x 4k" "batch 128 x 8k" "batch 64 mixed"; do
  $C --workload "$row" --config "$(s 1)" --config "$(s 4)" \
    --config "$(s 4 ', "combine_cols": 128')" "$@"
done
