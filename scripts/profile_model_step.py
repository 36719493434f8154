"""Where a bench model's training step spends its GPU time: the kernels of one step
(forward, backward, AdamW) of a variant, summed by name, the largest first.

    python scripts/profile_model_step.py --model qwen3-30b-a3b --variant eager tileops

The bench (`tileops bench-model`) gives the step's tokens/s; this shows which kernels the
variant left between it and a target (GEMMs at cuBLAS speed, MoE loops, the optimizer).
"""

import argparse
import collections

import torch

from tileops.transformers.bench import _apply_variant, make_model, make_optimizer

NAME_WIDTH = 100


def profile_step(model_name: str, variant: str, layers: int, seq: int, top: int) -> None:
    model = make_model(model_name, layers)
    _apply_variant(model, variant)
    model.train()
    opt = make_optimizer(model, variant)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: kernel builds, optimizer state
        step()
    torch.cuda.synchronize()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--variant", nargs="+", default=["eager", "tileops"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for variant in args.variant:
        profile_step(args.model, variant, args.layers, args.seq, args.top)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
