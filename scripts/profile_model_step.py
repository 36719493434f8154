"""Where a bench model's training step spends its GPU time: the kernels of one step
(forward, backward, AdamW) of a variant, summed by name, the largest first.

    python scripts/profile_model_step.py --model qwen3-30b-a3b --variant eager tileops

The bench (`tileops bench-model`) gives the step's tokens/s; this shows which kernels the
variant left between it and a target (GEMMs at cuBLAS speed, MoE loops, the optimizer).
"""

import argparse
import collections

import torch

from tileops.transformers.bench import warm_training_step

NAME_WIDTH = 100


def profile_step(model_name: str, variant: str, layers: int, seq: int, top: int) -> None:
    step = warm_training_step(model_name, variant, layers, seq)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
            counts[event.name] += 1
    whole = sum(totals.values())
    print(f"\n{model_name} ({layers} layers, {seq} tokens) {variant}: {whole / 1e3:.1f} ms of "
          f"GPU activity in one step, {sum(counts.values())} activities")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / 1e3:8.2f} ms {100 * us / whole:5.1f}%  x{counts[name]:<5d} "
              f"{name[:NAME_WIDTH]}")


def for_each_variant(report, description: str, model: str, variants: list[str]) -> None:
    """The command line of the bench-model step scripts (this one, memory_peak.py): one
    model, its variants in turn, `report(model, variant, layers, seq, top)` for each."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=model)
    parser.add_argument("--variant", nargs="+", default=variants)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for variant in args.variant:
        report(args.model, variant, args.layers, args.seq, args.top)
        torch.cuda.empty_cache()


def main() -> None:
    for_each_variant(profile_step, __doc__.splitlines()[0], "qwen3-30b-a3b",
                     ["eager", "tileops"])


if __name__ == "__main__":
    main()
