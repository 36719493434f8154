"""What a training step keeps for backward, accounted on meta tensors (no GPU, no memory).

`account(model, ids)` runs forward and backward of a causal LM with labels (meta device)
under `torch.autograd.graph.saved_tensors_hooks` and records every tensor saved for
backward: its shape and dtype, the innermost module whose forward saved it, the op that
produced the save (the last op dispatched before the pack hook), and its storage, so that
saves of one storage (views, a tensor saved by two ops) count once and parameters count
apart. After backward, with the loss (and so the whole graph) still alive, it records which
saved storages are still alive: an activation that outlives its backward node is held by
something else than the saved-tensor mechanism (a tensor in a ctx attribute, a cache), and
stays allocated through the optimizer step, the peak of a training step.

`tileops_on_meta()` lets the patched forwards take meta tensors (their ops have fake
implementations), so that a model patched by tileops.transformers.apply saves on meta what
it saves on the GPU.

    python3 -m tests.saved_tensors [--layers 2] [--seq 4096] [--peaks]

prints the per-layer table for the bench-model Llama-3.1-8B config: the unpatched model
(SDPA through tileops.attention's autograd: the flash backend's q, k, v, out, lse) and the
patched one; with --peaks, the peak bytes alive in the forward, backward and AdamW step
(`step_peaks`: custom ops' internal transients are not seen).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import re
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass
class Saved:
    module: str  # innermost module whose forward was running
    op: str  # the last op dispatched before the save
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # of the whole storage
    storage: int  # index of the storage in Account.storages
    param: bool  # a parameter's storage


@dataclasses.dataclass
class Account:
    saved: list[Saved]
    alive_after_backward: list[Saved]  # activations still held after backward, loss alive

    def layer_bytes(self) -> dict[str, int]:
        """Bytes of distinct non-parameter storages saved by each decoder layer ("layers.i")
        and outside the layers ("other"); a storage saved in two places counts once, in
        the first."""
        seen: set[int] = set()
        out: dict[str, int] = collections.defaultdict(int)
        for s in self.saved:
            if s.param or s.storage in seen:
                continue
            seen.add(s.storage)
            out[layer_of(s.module)] += s.nbytes
        return dict(out)


def layer_of(module: str) -> str:
    m = re.search(r"layers\.(\d+)", module)
    return f"layers.{m.group(1)}" if m else "other"


class _LastOp(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.name = "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.name = str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket")
                        else func)
        ns = getattr(func, "namespace", "aten")
        if ns != "aten":
            self.name = f"{ns}.{self.name}"
        return func(*args, **(kwargs or {}))


def account(model: torch.nn.Module, ids: torch.Tensor) -> Account:
    """Forward and backward of `model(input_ids=ids, labels=ids)` (meta tensors)."""
    stack: list[str] = []
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def enter(m: torch.nn.Module, args: Any) -> None:
        stack.append(names[m])

    def leave(m: torch.nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    for module in names:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    params = {id(p.untyped_storage()) for p in model.parameters()}
    storages: list[weakref.ref] = []
    index: dict[int, int] = {}  # id(storage) -> index, while the storage is alive
    saved: list[Saved] = []
    last = _LastOp()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = id(st)
        if key not in index or storages[index[key]]() is not st:
            index[key] = len(storages)
            storages.append(weakref.ref(st))
        saved.append(Saved(stack[-1] if stack else "", last.name, tuple(t.shape), t.dtype,
                           st.nbytes(), index[key], key in params))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), last:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        gc.collect()
        # the parameters' gradients (the fused loss's buffers become lm_head's) and the
        # caller's ids are alive by right
        kept = {id(t.untyped_storage()) for t in [ids, *(
            p.grad for p in model.parameters() if p.grad is not None)]}
        alive = {i for i, r in enumerate(storages) if r() is not None and id(r()) not in kept}
        held = [s for s in saved if s.storage in alive and not s.param]
        del loss
    finally:
        for h in handles:
            h.remove()
    return Account(saved, held)


def tensors_in_ctx(root: Any) -> list[str]:
    """Tensors that the Python nodes of the autograd graph under `root` (a grad_fn) hold as
    attributes (ctx.<name> = ..., in dicts, lists and tuples too): unlike saved tensors,
    they live as long as the graph, past their node's backward. One line per tensor."""
    found, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(f for f, _ in getattr(node, "next_functions", ()))
        for name, value in (vars(node) if hasattr(node, "__dict__") else {}).items():
            for t in _tensors(value):
                found.append(f"{type(node).__name__}.{name}: {list(t.shape)} {t.dtype}")
    return found


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class LiveBytes(TorchDispatchMode):
    """Bytes of distinct storages alive, and their peak, over what runs under the mode (and
    the tensors passed to `track`): the allocator's view of a step on meta tensors, less
    the transients inside custom ops (their fake implementations allocate only outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ref = self._refs.get(id(st))
        if ref is not None and ref() is st:
            return
        self._refs[id(st)] = weakref.ref(st)
        self.live += st.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, st.nbytes())

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        gc.collect()
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def step_peaks(model: torch.nn.Module, ids: torch.Tensor, steps: int = 2) -> dict[str, int]:
    """bench-model's training step (forward with labels, backward, AdamW, zero_grad) on
    meta tensors: the peak bytes alive in each phase of the last of `steps` steps (the
    earlier ones create the optimizer state)."""
    # foreach (meta tensors take no fused update): its parameter-sized temporary makes these
    # step peaks an upper bound of bench-model's fused AdamW (bench.make_optimizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    mode = LiveBytes()
    peaks: dict[str, int] = {}
    for p in model.parameters():
        mode.track(p)
    mode.track(ids)
    with mode:
        for _ in range(steps):
            mode.reset_peak()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            peaks["forward"] = mode.peak
            mode.reset_peak()
            loss.backward()
            peaks["backward"] = mode.peak
            mode.reset_peak()
            opt.step()
            peaks["optimizer step"] = mode.peak
            opt.zero_grad(set_to_none=True)
            del loss
    return peaks


@contextlib.contextmanager
def tileops_on_meta():
    """The patched forwards serve meta tensors (as they do CUDA ones): the ops' fake
    implementations run, with the autograd wiring of the real ops."""
    from tileops.transformers import attention as attn_impl

    real = attn_impl.served

    def served(*tensors: torch.Tensor | None) -> bool:
        ts = [t for t in tensors if t is not None]
        if ts and all(t.is_meta for t in ts):
            return len({t.dtype for t in ts}) == 1 and ts[0].dtype in attn_impl.KERNEL_DTYPES
        return real(*tensors)

    from transformers import masking_utils

    packed = masking_utils.find_packed_sequence_indices  # reads its result on the host
    attn_impl.served = served
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        attn_impl.served = real
        masking_utils.find_packed_sequence_indices = packed


def flash_like_sdpa():
    """transformers' "sdpa" attention as the CUDA flash backend saves it (q, k, v, out, lse),
    on meta tensors: through tileops.attention's autograd, which saves the same five."""
    return tileops_on_meta()


def table(accounts: dict[str, Account], layers: int) -> str:
    keys = [f"layers.{i}" for i in range(layers)] + ["other"]
    rows = ["| part | " + " | ".join(accounts) + " |",
            "|---|" + "---|" * len(accounts)]
    mib = 2 ** 20
    per = {name: a.layer_bytes() for name, a in accounts.items()}
    for k in keys:
        rows.append(f"| {k} | " + " | ".join(f"{per[n].get(k, 0) / mib:.1f} MiB"
                                              for n in accounts) + " |")
    rows.append("| held after backward | " + " | ".join(
        f"{sum(s.nbytes for s in _distinct(a.alive_after_backward)) / mib:.1f} MiB"
        for a in accounts.values()) + " |")
    return "\n".join(rows)


def _distinct(saved: list[Saved]) -> list[Saved]:
    seen: set[int] = set()
    out = []
    for s in saved:
        if s.storage not in seen:
            seen.add(s.storage)
            out.append(s)
    return out


def detail(account_: Account, layer: str = "layers.0") -> str:
    rows = []
    seen: set[int] = set()
    for s in account_.saved:
        if layer_of(s.module) != layer:
            continue
        dup = "param" if s.param else ("alias" if s.storage in seen else "")
        seen.add(s.storage)
        rows.append(f"  {s.module:40} {s.op:42} {str(list(s.shape)):22} "
                    f"{str(s.dtype)[6:]:9} {s.nbytes / 2 ** 20:8.1f} MiB {dup}")
    return "\n".join(rows)


def build(name: str, layers: int, variant: str) -> torch.nn.Module:
    """bench-model's random-init model on meta: "tileops" patched, "eager" on SDPA as its
    CUDA flash backend saves (q, k, v, out, lse: tileops.attention's autograd on meta).
    Run it inside `tileops_on_meta()`."""
    import tileops.transformers as tt
    from tileops.transformers import attention as attn_impl
    from tileops.transformers import bench

    model = bench.make_model(name, layers, attn="sdpa", device="meta")
    model.train()
    if variant == "tileops":
        tt.apply(model, verbose=False)
    else:
        attn_impl.register()
        model.set_attn_implementation(attn_impl.NAME)
    return model


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--peaks", action="store_true",
                    help="also the peak bytes of each phase of a training step with AdamW")
    args = ap.parse_args()
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    accounts: dict[str, Account] = {}
    for variant in ("eager", "tileops"):
        with tileops_on_meta():
            accounts[variant] = account(build(args.model, args.layers, variant), ids)
            if args.peaks:
                peaks = step_peaks(build(args.model, args.layers, variant), ids)
                print(f"## {variant}, peaks: " + ", ".join(
                    f"{k} {v / 2 ** 30:.3f} GiB" for k, v in peaks.items()) + "\n")
        print(f"## {variant}, layer 0\n{detail(accounts[variant])}\n")
        print(f"## {variant}, outside the layers\n{detail(accounts[variant], 'other')}\n")
        print(f"## {variant}, held after backward\n" + "\n".join(
            f"  {s.module} {s.op} {list(s.shape)}"
            for s in _distinct(accounts[variant].alive_after_backward)) + "\n")
    print(table(accounts, args.layers))


if __name__ == "__main__":
    _main()
