"""What is allocated at the peak of a bench model's training step: the step (forward,
backward, AdamW) of each variant under the CUDA caching allocator's recorder, its trace
replayed to the moment of the most memory allocated, and the blocks live then summed by
the line of Python that allocated them (the first frame in tileops, liger_kernel or
transformers, else the innermost).

    python scripts/memory_peak.py --model llama-3.1-8b --variant tileops liger

Blocks allocated before the recorded step (parameters, optimizer state) show as one
`before the step` line, less what the step freed of them. The bench (`tileops bench-model`)
gives the peak; this says what makes one variant's higher than another's.
"""

import collections

import torch
from profile_model_step import for_each_variant

from tileops.transformers.bench import warm_training_step

OWN = ("tileops", "liger_kernel", "transformers")


def _site(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(f"/{own}/" in name for own in OWN):
            short = name[name.rfind("/", 0, name.rfind("/")) + 1:]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame of a model library)" if not frames else \
        f"{frames[0].get('filename', '?').rsplit('/', 1)[-1]}:{frames[0].get('line')}"


def peak_report(model_name: str, variant: str, layers: int, seq: int, top: int) -> None:
    step = warm_training_step(model_name, variant, layers, seq)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_seen = torch.cuda.max_memory_allocated()

    def replay(stop: int | None) -> tuple[int, int, dict[int, dict]]:
        live: dict[int, dict] = {}
        current, best, best_at = before, before, -1
        for i, entry in enumerate(trace[:stop]):
            action = entry["action"]
            if action == "alloc":
                live[entry["addr"]] = entry
                current += entry["size"]
            elif action == "free_completed":
                current -= entry["size"]
                live.pop(entry["addr"], None)
            if current > best:
                best, best_at = current, i
        return best, best_at, live

    best, best_at, _ = replay(None)
    _, _, live = replay(best_at + 1)
    by_site: dict[str, int] = collections.defaultdict(int)
    for entry in live.values():
        by_site[_site(entry.get("frames", []))] += entry["size"]
    in_step = sum(by_site.values())
    print(f"\n{model_name} ({layers} layers, {seq} tokens) {variant}: peak {best / 2**30:.3f} "
          f"GiB by the trace ({peak_seen / 2**30:.3f} by the allocator's counter), "
          f"{len(trace)} trace entries, peak at entry {best_at}")
    print(f"  {(best - in_step) / 2**20:9.1f} MiB  before the step (parameters, optimizer "
          "state; less what the step had freed)")
    for site, size in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {size / 2**20:9.1f} MiB  {site}")


def main() -> None:
    for_each_variant(peak_report, __doc__.splitlines()[0], "llama-3.1-8b",
                     ["tileops", "liger"])


if __name__ == "__main__":
    main()
