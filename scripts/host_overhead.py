"""Host time per call of each layer of a launch (no L2 flush, device work is tiny).

    python scripts/host_overhead.py          # on the GPU: real launches
    python scripts/host_overhead.py --stub   # on any machine: CPU tensors, and every
                                             # TileLang launch replaced by a Python no-op

The layers of an eager call: Op.__call__ -> validate (signature cache) -> forward ->
get_kernel -> Kernel.__call__ -> select -> launch. `--stub` times all of them except
TileLang's launch (and with CPU instead of CUDA allocations): what the Python side adds.
"""

import argparse
import contextlib
import sys
import time
import timeit
from unittest import mock

import torch

import tileops
from tileops import GemmFwdOp, LayerNormFwdOp, RMSNormFwdOp


def _noop(*args):
    return None


@contextlib.contextmanager
def stub_launches():
    """CPU tensors pass the ops' device check and every kernel 'compiles' to a Python no-op
    (so Kernel.__call__, select and each op's own run() still run, minus the launch)."""
    from tileops.kernels import base as kernels_base
    from tileops.ops import base as ops_base

    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        check = ops_base.Op.check
        enter(mock.patch.object(ops_base.Op, "check",  # any device: CPU tensors pass
                                lambda self, inputs, require_cuda=False: check(self, inputs)))
        enter(mock.patch.object(ops_base, "target_for_device",
                                lambda device, op="": kernels_base.SM90A))
        enter(mock.patch.dict(ops_base._gpu_names, {0: "h200"}))
        # kernels made here launch nothing: none may outlive the stub
        enter(mock.patch.dict(ops_base.Op._kernels))
        enter(mock.patch.dict(kernels_base.Kernel._compiled))
        enter(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        enter(mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda index: 0,
                                create=True))  # (a CPU build has no streams)
        enter(mock.patch.object(kernels_base.Kernel, "compile",
                                lambda self, config, bucket: (_noop,) * 4))
        enter(mock.patch.object(kernels_base, "launchers", lambda compiled: compiled))
        try:
            yield
        finally:  # what the shared instances learnt of CPU calls is forgotten with the stub
            for op_class in _op_classes(ops_base.Op):
                op_class.__dict__.get("_keyed_launches", {}).clear()
                for instance in op_class.__dict__.get("_instances", {}).values():
                    for cache in ("_validated", "_kernel_memo", "_call_memo"):
                        getattr(instance, cache, set()).clear()


def _op_classes(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _op_classes(sub)


def cpu_us(fn, calls=2000):
    """Best of 3 runs of `calls` calls, in CPU-time us per call (no device to wait for; CPU
    time, so that other processes on a shared machine count less)."""
    for _ in range(50):
        fn()
    runs = timeit.repeat(fn, number=calls, repeat=3, timer=time.process_time)
    return min(runs) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stub", action="store_true",
                        help="CPU tensors, launches replaced by a no-op (no GPU needed)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="rounds over every row, interleaved (a shared host's load "
                             "drifts: each row reports its best and median round)")
    args = parser.parse_args()
    if args.stub:
        with stub_launches():
            rows = layer_rows("cpu")
            report(rows, lambda fn: cpu_us(fn, calls=500), args.rounds)
    else:
        from tileops.perf.timing import call_latency_us

        rows = layer_rows("cuda")
        report(rows, lambda fn: call_latency_us(fn, calls=1000), args.rounds)
        print("dlpack exchange api:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
              hasattr(torch.Tensor, "__c_dlpack_exchange_api__"))


def layer_rows(device):
    stub = device == "cpu"
    x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    x_grad = x.clone().requires_grad_()
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-5)
    op(x, w)
    key = op._kernel_key(x.dtype, 4096, has_weight=True)
    kernel = op.get_kernel("rms_norm", x.device, **key)
    exe = kernel.select(64)[1][0]  # the TVM-FFI executable the op launches
    rows = {}
    if not stub:  # torch on the CPU computes: no stand-in for its CUDA host time
        rows["torch F.rms_norm"] = lambda: torch.nn.functional.rms_norm(x, [4096], w, 1e-5)
    rows.update({
        "torch.empty_like": lambda: torch.empty_like(x),
        "no-op launcher" if stub else "tvm-ffi executable": lambda: exe(x, w, y, 1e-5),
        "Kernel.__call__": lambda: kernel(64, x, w, y, 1e-5),
        "op.check": lambda: op.check([x, w], require_cuda=True),
        "op.validate (seen signature)": lambda: op.validate((x, w)),
        "op.get_kernel": lambda: op.get_kernel("rms_norm", x.device, **key),
        "op.forward": lambda: op.forward(x, w),
        "RMSNormFwdOp()": lambda: op(x, w),
        "tileops.rms_norm": lambda: tileops.rms_norm(x, [4096], w, 1e-5),
        "torch.ops.tileops.rms_norm_fwd": lambda: torch.ops.tileops.rms_norm_fwd(x, [4096], w,
                                                                               1e-5),
        "tileops.rms_norm, input requires grad": lambda: tileops.rms_norm(x_grad, [4096], w,
                                                                          1e-5),
    })
    if not stub:
        rows["torch add + F.rms_norm"] = lambda: torch.nn.functional.rms_norm(x + y, [4096],
                                                                              w, 1e-5)
    rows.update({
        "tileops.fused_add_rms_norm": lambda: tileops.fused_add_rms_norm(x, y, w, 1e-5),
        "tileops.fused_add_rms_norm_": lambda: tileops.fused_add_rms_norm_(x, y, w, 1e-5),
    })
    if not stub:
        rows["torch F.layer_norm"] = lambda: torch.nn.functional.layer_norm(x, [4096], w, w)
    ln = LayerNormFwdOp(normalized_shape=[4096])
    rows.update({
        "LayerNormFwdOp()": lambda: ln(x, w, w),
        "tileops.layer_norm": lambda: tileops.layer_norm(x, [4096], w, w),
        "torch.ops.tileops.layer_norm_fwd": lambda: torch.ops.tileops.layer_norm_fwd(
            x, [4096], w, w, 1e-5),
    })
    a = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(6144, 4096, device=device, dtype=torch.bfloat16)
    g = GemmFwdOp()
    g(a, b)
    if not stub:
        rows["torch.matmul 16x6144x4096"] = lambda: torch.matmul(a, b.t())
    rows.update({
        "GemmFwdOp() 16x6144x4096": lambda: g(a, b),
        "tileops.gemm 16x6144x4096": lambda: tileops.gemm(a, b),
        "torch.ops.tileops.gemm_fwd 16x6144x4096": lambda: torch.ops.tileops.gemm_fwd(
            a, b, False, True),
    })
    rows.update(other_op_rows(device))
    return rows


def other_op_rows(device):
    """One eager call of a few more ops (decode-sized), each after torch's equivalent."""
    import torch.nn.functional as F

    stub = device == "cpu"
    gate_up = torch.randn(64, 2 * 4096, device=device, dtype=torch.bfloat16)
    logits = torch.randn(64, 32000, device=device, dtype=torch.bfloat16)
    a = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device=device, dtype=torch.bfloat16)
    qkv = list(w.split([4096, 1024, 1024]))  # (contiguous row blocks: no copies)
    pairs = {
        "silu_and_mul [64, 2x4096]": (
            lambda: F.silu(gate_up[:, :4096]) * gate_up[:, 4096:],
            lambda: tileops.silu_and_mul(gate_up)),
        "softmax [64, 32000]": (lambda: torch.softmax(logits, -1),
                                lambda: tileops.softmax(logits)),
        "argmax [64, 32000]": (lambda: torch.argmax(logits, -1),
                               lambda: tileops.argmax(logits, -1)),
        "linear 16x6144x4096": (lambda: F.linear(a, w), lambda: tileops.linear(a, w)),
        "q/k/v 16x(4096+1024+1024)x4096": (lambda: [F.linear(a, t) for t in qkv],
                                           lambda: tileops.linear_group(a, qkv)),
    }
    rows = {}
    for name, (torch_fn, ours) in pairs.items():
        if not stub:
            rows[f"torch {name}"] = torch_fn
        ours()
        rows[f"tileops {name}"] = ours
    return rows


def report(rows, time_us, rounds):
    """Each row timed once a round, rows interleaved, `rounds` rounds: best and median."""
    import statistics

    times = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            times[name].append(time_us(fn))
    print(f"{'layer':44s} host us/call: best, median of {rounds} rounds")
    for name, ts in times.items():
        print(f"{name:44s} {min(ts):8.2f} {statistics.median(ts):8.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
