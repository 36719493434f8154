"""Builds, without a GPU, the TileOPs programs of the Hugging Face exactness test
(tests/test_transformers_gpu.py::test_logits_loss_and_gradients_match): each family's small
patched model runs its eval forward and a training forward + backward on the meta device
while `prebuild.recording()` notes every op call; the programs those calls build are
compiled for sm_90a into $TILEOPS_CACHE_DIR. On the GPU the test then loads them instead
of compiling (11 cases took over 200 s compiling there, 38 s prebuilt).

    TILEOPS_CACHE_DIR=.tilecache python scripts/prebuild_hf_tests.py [--family llama ...]
"""

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.hf_models

import torch  # noqa: E402
from tests import hf_models  # noqa: E402
from tests.test_transformers_gpu import BATCH, FAMILIES, HEAD_DIM, SEQ  # noqa: E402
from transformers import masking_utils  # noqa: E402

import tileops.transformers as tt  # noqa: E402
from tileops.cli import _compile_plan  # noqa: E402
from tileops.prebuild import recorded_plan, recording  # noqa: E402


def recorded_calls(family: str, dtype: torch.dtype) -> list:
    model = hf_models.model(family, **HEAD_DIM.get(family, {})).to(dtype).to("meta")
    tt.apply(model, verbose=False)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    # a meta tensor has no values to look for packed sequences in
    unpacked = mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                 lambda *a, **k: None)
    with unpacked, recording() as calls:
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    # the test's cases: every family in bf16, Llama and Qwen3 in fp16 too
    cases = [(f, torch.bfloat16) for f in args.family]
    cases += [(f, torch.float16) for f in ("llama", "qwen3") if f in args.family]
    calls = []
    for family, dtype in cases:
        calls += recorded_calls(family, dtype)
    return _compile_plan(recorded_plan(calls, label="hf-tests"), "sm_90a", args.jobs)


if __name__ == "__main__":
    sys.exit(main())
