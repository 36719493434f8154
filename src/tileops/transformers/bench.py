"""`tileops bench-model`: end-to-end speed of random-init models with real configs.

For each model and variant, in a fresh subprocess (patches such as Liger's replace
module-level classes, and peak memory must be the variant's own):
- a training step (forward, backward, AdamW step) on `batch x seq` tokens: tokens/s and the
  peak memory allocated, over the whole step and over forward + backward alone;
- generation with a static KV cache at each decode batch: the prefill latency (a generate
  call of one new token) and decode tokens/s ((N - 1) tokens per sequence between a
  one-token and an N-token call), which include transformers' generate loop on the host;
- for the compiled variants, the decode step alone under CUDA graphs (`graph_decode_ms`: the
  forward of one token a sequence onto the static cache compiled with CUDA graphs, then
  the greedy argmax and the position update, step after step with no generate loop
  between, as a serving engine runs it): the GPU time of a step, which the host-side
  generate loop hides when it is the slower of the two.

Variants: `eager` (transformers' SDPA model, no compile; generation with compile
disabled), `compile` (torch.compile of the unpatched model for training; transformers'
automatic compile of the static-cache decode step, CUDA graphs included), `liger`
(Liger-Kernel's apply_liger_kernel_to_<family>(model=...), when importable), `tileops`
(tileops.transformers.apply) and `tileops-compile` (both). Weights are random: the numbers
measure speed, not quality. Writes bench-model.md, bench-model.json and, with matplotlib,
bench-model.png under --out.

`recorded_programs` (`tileops bench-model --compile-only`) runs the tileops variant's
training step and a prefill + decode step on the meta device inside `prebuild.recording()`:
the TileOPs programs those steps build on a GPU, listed (and compiled) without one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("eager", "compile", "liger", "tileops", "tileops-compile")
# how decode speed is measured: transformers' generate loop, and/or a captured decode step
DECODE_MODES = ("generate", "graph")

# Real configs (config.json of each model, the fields that shape the compute); `layers`
# overrides num_hidden_layers so that one GPU holds the model and its optimizer state.
_LLAMA31_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    rope_theta=500000.0, hidden_act="silu",
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA31_8B,
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_theta=1000000.0, hidden_act="silu"),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_theta=1000000.0, hidden_act="silu"),
    "mistral-7b-v0.3": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_theta=1000000.0, sliding_window=None, hidden_act="silu"),
    "gemma-2-9b": dict(
        model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
        rms_norm_eps=1e-6, max_position_embeddings=8192, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
}


@dataclasses.dataclass
class Case:
    model: str
    variant: str
    layers: int
    batch: int
    seq: int
    gen_batches: tuple[int, ...]
    prompt: int
    new_tokens: int
    steps: int
    train: bool
    generate: bool
    decode: tuple[str, ...] = DECODE_MODES
    optimizer: str = "tileops"  # the tileops variants' optimizer (see make_optimizer)


OPTIMIZERS = ("tileops", "torch")


def make_optimizer(model: Any, variant: str = "eager", optimizer: str = "tileops") -> Any:
    """The training step's optimizer. The unpatched variants (eager, compile, liger) step
    with AdamW's fused CUDA update, what transformers' Trainer runs by default
    (`optim="adamw_torch_fused"`; torch's own default, foreach, took 94 of the eager
    Qwen3-30B-A3B step's 197 ms of GPU time, 8 layers, H100, fortieth session). The tileops
    variants step with `tileops.optim.AdamW` unless `optimizer` is "torch" (then the fused
    update too: the model's patching alone)."""
    import torch

    if variant.startswith("tileops") and optimizer == "tileops":
        from ..optim import AdamW

        return AdamW(model.parameters(), lr=1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def make_model(name: str, layers: int | None, attn: str | None = None,
               device: str = "cuda") -> Any:
    """The random-init bf16 model of `name`'s config, built on `device`."""
    import torch
    import transformers

    spec = dict(MODELS[name])
    model_type = spec.pop("model_type")
    if layers:
        spec["num_hidden_layers"] = layers
    if model_type == "gemma2":
        spec["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(spec["num_hidden_layers"])]
    config = transformers.AutoConfig.for_model(model_type, **spec)
    config._attn_implementation = attn or ("eager" if model_type == "gemma2" else "sdpa")
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def _apply_variant(model: Any, variant: str) -> str:
    """Patches `model` for `variant`; returns a note for the report."""
    if variant in ("tileops", "tileops-compile"):
        from . import apply

        report = apply(model, verbose=False)
        return "; ".join(sorted({f"{k} on PyTorch: {why}" for k, _, why in report.unpatched}))
    if variant == "liger":
        import liger_kernel.transformers as liger

        fn = getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}", None)
        if fn is None:
            raise RuntimeError(f"Liger has no apply_liger_kernel_to_{model.config.model_type}")
        fn(model=model)
    return ""


def _sync_time(fn: Any, repeat: int) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def _generate_times(model: Any, batch: int, case: Case, compiled: bool) -> dict[str, float]:
    """transformers' generate with a static cache: the prefill latency (one new token) and
    decode tokens/s between a one-token and an N-token call."""
    import torch

    # ids from 1: no pad token (0) in the prompt, so no inferred padding mask
    prompt = torch.randint(1, model.config.vocab_size, (batch, case.prompt), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", disable_compile=not compiled,
              pad_token_id=0)

    def call(n: int) -> None:
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.no_grad():
        call(case.new_tokens)  # warm-up (compile, CUDA graph capture)
        call(1)
        t1 = _sync_time(lambda: call(1), 2)
        tn = _sync_time(lambda: call(case.new_tokens), 2)
    return {"prefill_ms": t1 * 1e3,
            "decode_tokens_per_s": batch * (case.new_tokens - 1) / (tn - t1)}


class DecodeStep:
    """One greedy decode step of one token a sequence onto a static cache, on fixed buffers:
    `token` [B, 1] (the step's input, overwritten by its argmax) and `position` [1] (the
    cache position, advanced by one): so the step can be captured in a CUDA graph and
    replayed with no host work between steps. `prefill` fills the cache with `ids` first."""

    def __init__(self, model: Any, ids: Any, steps: int, forward: Any = None) -> None:
        import torch
        import transformers

        from .static_cache import cache_kwarg

        batch, self.prompt = ids.shape
        s_max = self.prompt + steps  # generate's static cache for `steps` new tokens
        self.model, self.ids = model, ids
        self.forward = forward or model.forward
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=s_max)
        self.kw = {cache_kwarg(model.model): self.cache, "use_cache": True,
                   "logits_to_keep": 1}
        # a mask of the cache's length: causality (keys up to the position) masks the rest
        self.mask = torch.ones(batch, s_max, dtype=torch.long, device=ids.device)
        self.token = ids[:, -1:].clone()
        self.position = torch.full((1,), self.prompt, dtype=torch.long, device=ids.device)

    def prefill(self) -> None:
        """The prompt into the emptied cache by transformers' own generate (one new token:
        its prefill forward, whose greedy token becomes `token`); steps go on from there.
        (The reset matters: a static layer appends at its own running length, not at the
        cache_position it is given, in transformers 5.17.)"""
        self.cache.reset()
        out = self.model.generate(self.ids, attention_mask=self.mask[:, :self.prompt]
                                  .contiguous(), past_key_values=self.cache, max_new_tokens=1,
                                  do_sample=False, disable_compile=True, pad_token_id=0)
        self.token.copy_(out[:, -1:])
        self.position.fill_(self.prompt)

    def __call__(self) -> None:
        logits = self.forward(input_ids=self.token, attention_mask=self.mask,
                              cache_position=self.position, **self.kw).logits
        self.token.copy_(logits[:, -1:].argmax(-1))
        self.position.add_(1)


def graph_decode(model: Any, batch: int, prompt: int, steps: int) -> dict[str, Any]:
    """Greedy decode steps of `model` compiled whole with CUDA graphs (torch.compile,
    fullgraph, mode "reduce-overhead": transformers' own compile of the static-cache decode
    step) after a `prompt`-token prefill: `graph_decode_ms`, the median of `steps` steps'
    GPU times (CUDA events; a step is the graph's replay plus the argmax token and position
    writes, the host work between replays a few tens of microseconds, far under a step's
    GPU time), and `graph_decode_kernels`, one step's kernels summed by name (us, the
    largest first)."""
    import collections

    import torch

    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda")
    step = DecodeStep(model, ids, steps, torch.compile(
        model.forward, fullgraph=True, dynamic=False, mode="reduce-overhead"))
    with torch.no_grad():
        step.prefill()
        torch.cuda.synchronize()  # (an error surfaces in the phase that made it)
        for _ in range(3):  # compile, CUDA graph capture, kernel builds
            step()
        torch.cuda.synchronize()
        step.prefill()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        events[0].record()
        for e in events[1:]:
            step()
            e.record()
        torch.cuda.synchronize()
        step.prefill()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(events[:-1], events[1:], strict=True))
    kernels: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:120]] += event.device_time
    return {"graph_decode_ms": times[len(times) // 2],
            "graph_decode_kernels": sorted(kernels.items(), key=lambda kv: -kv[1])[:20]}


def warm_training_step(name: str, variant: str, layers: int, seq: int,
                       batch: int = 1) -> Callable[[], None]:
    """A training step (forward, backward, the variant's optimizer step, zero_grad) of a
    bench model patched for `variant`, warmed up twice (kernel builds, optimizer state):
    what the profiling scripts look inside."""
    import torch

    model = make_model(name, layers)
    _apply_variant(model, variant)
    model.train()
    opt = make_optimizer(model, variant)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    return step


def run_case(case: Case) -> dict[str, Any]:
    """One variant of one model, in this process."""
    import torch

    result: dict[str, Any] = {"model": case.model, "variant": case.variant,
                              "layers": case.layers}
    model = make_model(case.model, case.layers)
    result["note"] = _apply_variant(model, case.variant)
    compiled = case.variant in ("compile", "tileops-compile")
    vocab = model.config.vocab_size
    if case.train:
        model.train()
        step_model = torch.compile(model) if compiled else model
        opt = make_optimizer(model, case.variant, case.optimizer)
        result["optimizer"] = type(opt).__module__.split(".")[0] + ".AdamW"
        ids = torch.randint(0, vocab, (case.batch, case.seq), device="cuda")

        # per step: the peak of forward + backward (activations, the loss's buffers) and of
        # the whole step (forward + backward's, or the optimizer state's first allocation)
        peaks: dict[str, list[int]] = {"fwd_bwd": [], "step": []}

        def step() -> None:
            torch.cuda.reset_peak_memory_stats()  # host-side allocator stats: no sync
            loss = step_model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            peaks["fwd_bwd"].append(torch.cuda.max_memory_allocated())
            opt.step()
            opt.zero_grad(set_to_none=True)
            peaks["step"].append(torch.cuda.max_memory_allocated())

        for _ in range(2):  # warm-up: compiles, kernel builds, optimizer state
            step()
        for v in peaks.values():
            v.clear()
        seconds = _sync_time(step, case.steps)
        result["train_tokens_per_s"] = case.batch * case.seq / seconds
        result["train_peak_gib"] = max(peaks["step"]) / 2**30
        result["train_fwd_bwd_peak_gib"] = max(peaks["fwd_bwd"]) / 2**30
        del opt, step_model
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    if case.generate:
        model.eval()
        gen: dict[int, dict[str, float]] = {}
        for batch in case.gen_batches:
            gen[batch] = {}
            if "generate" in case.decode:
                gen[batch].update(_generate_times(model, batch, case, compiled))
            if "graph" in case.decode and compiled:
                gen[batch].update(graph_decode(model, batch, case.prompt, case.new_tokens))
        result["generate"] = gen
    return result


def recorded_programs(models: list[str], layers: dict[str, int], batch: int, seq: int,
                      gen_batches: tuple[int, ...], prompt: int, new_tokens: int, train: bool,
                      generate: bool) -> list[Any]:
    """The programs (prebuild.BuildItem) the tileops variants build for these cases: their
    training step and, per decode batch, a static-cache prefill and decode step, run on the
    meta device while recording (shapes only: no GPU, no memory, no kernel)."""
    import contextlib
    from unittest import mock

    import torch
    import transformers
    from transformers import masking_utils

    from ..prebuild import recorded_plan, recording
    from . import _patch, apply
    from .static_cache import cache_kwarg

    calls: list[Any] = []
    # a meta tensor has no values to test for packed sequences (one fresh batch is not)
    unpacked = mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                 lambda *a, **k: None)
    # the decode step runs compiled on the GPU, where its Linear calls take tileops.linear
    # (linear="decode"); here it runs eagerly on meta tensors
    graphed = mock.patch.object(_patch, "_graphed", lambda: True)
    for name in models:
        model = make_model(name, min(layers.get(name) or 2, 2), device="meta")
        apply(model, verbose=False)
        with contextlib.ExitStack() as stack:
            stack.enter_context(unpacked)
            stack.enter_context(graphed)
            recorded = stack.enter_context(recording())
            if train:
                ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
                model.train()
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                make_optimizer(model, "tileops").step()
            model.eval()
            stack.enter_context(torch.no_grad())
            for b in gen_batches if generate else ():
                cache = transformers.StaticCache(config=model.config,
                                                 max_cache_len=prompt + new_tokens)
                kw = {cache_kwarg(model.model): cache, "use_cache": True}
                for start, count in ((0, prompt), (prompt, 1)):
                    ids = torch.zeros(b, count, dtype=torch.long, device="meta")
                    model(input_ids=ids, cache_position=torch.arange(
                        start, start + count, device="meta"), **kw)
        calls += recorded
    return recorded_plan(calls, label="bench-model")


def run(models: list[str], variants: list[str], layers: dict[str, int], batch: int, seq: int,
        gen_batches: tuple[int, ...], prompt: int, new_tokens: int, steps: int, train: bool,
        generate: bool, out: pathlib.Path, timeout: int,
        decode: tuple[str, ...] = DECODE_MODES,
        optimizer: str = "tileops") -> list[dict[str, Any]]:
    """Runs every (model, variant) in its own subprocess; writes the reports; returns rows."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in models:
        for variant in variants:
            case = Case(name, variant, layers.get(name, 0), batch, seq, tuple(gen_batches),
                        prompt, new_tokens, steps, train, generate, tuple(decode), optimizer)
            rows.append(_subprocess(case, timeout))
            print(_row_line(rows[-1]), flush=True)
            _write(rows, out)
    return rows


def _subprocess(case: Case, timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tileops.transformers.bench", json.dumps(
        dataclasses.asdict(case))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"model": case.model, "variant": case.variant, "error": f"timed out {timeout}s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"model": case.model, "variant": case.variant, "error": " | ".join(tail)[-400:]}


def _row_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']:16} {row['variant']:16} error: {row['error']}"
    parts = [f"{row['model']:16} {row['variant']:16}"]
    if "train_tokens_per_s" in row:
        parts.append(f"{row.get('optimizer', '')} train {row['train_tokens_per_s']:9.0f} tok/s "
                     f"{row['train_peak_gib']:6.1f} GiB (fwd+bwd "
                     f"{row.get('train_fwd_bwd_peak_gib', float('nan')):.1f})")
    for b, g in (row.get("generate") or {}).items():
        if "prefill_ms" in g:
            parts.append(f"b{b}: prefill {g['prefill_ms']:.1f} ms decode "
                         f"{g['decode_tokens_per_s']:.0f} tok/s")
        if "graph_decode_ms" in g:
            parts.append(f"b{b}: graph decode step {g['graph_decode_ms'] * 1e3:.0f} us")
    return "  ".join(parts)


def _write(rows: list[dict[str, Any]], out: pathlib.Path) -> None:
    (out / "bench-model.json").write_text(json.dumps(rows, indent=1))
    lines = ["# tileops bench-model", "",
             "Random-init bf16 models with the real configs (layer counts as listed). Speed-up "
             "columns are against the same model's `eager` row.", "",
             "## Training step (forward, backward, AdamW)", "",
             "| model | layers | variant | optimizer | tokens/s | vs eager | peak GiB "
             "| fwd+bwd peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    eager = {r["model"]: r for r in rows if r.get("variant") == "eager" and "error" not in r}
    for r in rows:
        if "train_tokens_per_s" in r:
            base = eager.get(r["model"], {}).get("train_tokens_per_s")
            ratio = f"{r['train_tokens_per_s'] / base:.2f}x" if base else "-"
            fwd_bwd = r.get("train_fwd_bwd_peak_gib")
            lines.append(f"| {r['model']} | {r['layers'] or 'all'} | {r['variant']} | "
                         f"{r.get('optimizer', '-')} | {r['train_tokens_per_s']:.0f} | {ratio} | "
                         f"{r['train_peak_gib']:.1f} | "
                         f"{'-' if fwd_bwd is None else f'{fwd_bwd:.1f}'} |")
    lines += ["", "## Generation with a static KV cache", "",
              "Decode tokens/s through transformers' generate (its host loop included); "
              "the graph step: one decode step of the compiled model replayed from a CUDA "
              "graph (GPU time), against the `compile` row's.", "",
              "| model | variant | batch | prefill ms | decode tokens/s | vs eager "
              "| graph step us | graph tokens/s | vs compile |",
              "|---|---|---|---|---|---|---|---|---|"]
    compiled = {r["model"]: r for r in rows if r.get("variant") == "compile"}
    for r in rows:
        for b, g in (r.get("generate") or {}).items():
            lines.append(f"| {r['model']} | {r['variant']} | {b} | "
                         + " | ".join(_decode_cells(g, eager, compiled, r["model"], b)) + " |")
    notes = [f"- {r['model']} {r['variant']}: {r.get('error') or r.get('note')}" for r in rows
             if r.get("error") or r.get("note")]
    if notes:
        lines += ["", "## Notes and errors", "", *notes]
    (out / "bench-model.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out)


def _decode_cells(g: dict[str, float], eager: dict[str, Any], compiled: dict[str, Any],
                  model: str, batch: int) -> list[str]:
    """The generation table's cells of one (variant, batch): '-' where not measured."""
    def base(rows: dict[str, Any], key: str) -> float | None:
        return ((rows.get(model, {}).get("generate") or {}).get(batch) or {}).get(key)

    cells = ["-"] * 6
    if "prefill_ms" in g:
        ref = base(eager, "decode_tokens_per_s")
        cells[:3] = [f"{g['prefill_ms']:.1f}", f"{g['decode_tokens_per_s']:.0f}",
                     f"{g['decode_tokens_per_s'] / ref:.2f}x" if ref else "-"]
    if "graph_decode_ms" in g:
        ref = base(compiled, "graph_decode_ms")
        ms = g["graph_decode_ms"]
        cells[3:] = [f"{ms * 1e3:.0f}", f"{int(batch) / ms * 1e3:.0f}",
                     f"{ref / ms:.2f}x" if ref else "-"]
    return cells


def _plot(rows: list[dict[str, Any]], out: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    train = [r for r in rows if "train_tokens_per_s" in r]
    if not train:
        return
    fig, ax = plt.subplots(figsize=(max(6, len(train) * 0.9), 4))
    ax.bar([f"{r['model']}\n{r['variant']}" for r in train],
           [r["train_tokens_per_s"] for r in train])
    ax.set_ylabel("training tokens/s")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench-model.png", dpi=120)
    plt.close(fig)


def _main_one(arg: str) -> int:
    spec = json.loads(arg)
    spec["gen_batches"] = tuple(spec["gen_batches"])
    spec["decode"] = tuple(spec["decode"])
    try:
        result = run_case(Case(**spec))
    except Exception as e:  # reported in the table, not fatal to the sweep
        import traceback

        result = {"model": spec["model"], "variant": spec["variant"],
                  "error": f"{type(e).__name__}: {e}"[:400],
                  "traceback": traceback.format_exc()[-6000:]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main_one(sys.argv[1]))
