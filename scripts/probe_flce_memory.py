"""Where fused_linear_cross_entropy's peak memory goes (Llama-3.1-8B head, 4K tokens):
memory after the forward and inside the backward, and whether autograd took the op's
gradient buffers as the leaves' .grad (steal) or copied them. The open question of issue 18:
1034 MiB above inputs and outputs, exactly one more copy of grad_weight + grad_hidden; on
the CPU (torch 2.13, a torch stand-in for the op's body) both gradients are stolen.

    bash .gpu/remote.sh bash scripts/gpu_session.sh tests ... ; \
    bash .gpu/remote.sh bash -c 'PYTHONPATH=$PYTHONPATH:/tmp/wheels \
        python3 scripts/probe_flce_memory.py'

(the manifest needs jsonschema, which gpu_session.sh installs into /tmp/wheels)
"""
import importlib

import torch

import tileops

flce = importlib.import_module("tileops.ops.fused_linear_cross_entropy")

MiB = 2 ** 20
tokens, width, vocab = 4096, 4096, 128256
hidden = (torch.randn(tokens, width, device="cuda")).bfloat16().requires_grad_()
weight = (torch.randn(vocab, width, device="cuda") * width ** -0.5).bfloat16().requires_grad_()
target = torch.randint(0, vocab, (tokens,), device="cuda")
tileops.fused_linear_cross_entropy(hidden, weight, target).backward()
hidden.grad = weight.grad = None
torch.cuda.synchronize()
ptrs = {}
orig = flce._backward


def spy(ctx, grad_loss, *rest):
    gh, gw = ctx.saved_tensors[:2]
    ptrs["gh"], ptrs["gw"] = gh.data_ptr(), gw.data_ptr()
    print(f"in backward: allocated {torch.cuda.memory_allocated() / MiB:.0f} MiB, "
          f"peak {torch.cuda.max_memory_allocated() / MiB:.0f}")
    return orig(ctx, grad_loss, *rest)


tileops.FusedLinearCrossEntropyFwdOp.register_autograd(spy, setup_context=flce._setup)
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
print(f"base {base / MiB:.0f} MiB")
loss = tileops.fused_linear_cross_entropy(hidden, weight, target)
torch.cuda.synchronize()
print(f"after forward: +{(torch.cuda.memory_allocated() - base) / MiB:.0f} MiB, "
      f"peak +{(torch.cuda.max_memory_allocated() - base) / MiB:.0f}")
loss.backward()
torch.cuda.synchronize()
print(f"after backward: +{(torch.cuda.memory_allocated() - base) / MiB:.0f} MiB, peak "
      f"+{(torch.cuda.max_memory_allocated() - base) / MiB:.0f}; grads stolen (no copy): "
      f"hidden {hidden.grad.data_ptr() == ptrs['gh']}, "
      f"weight {weight.grad.data_ptr() == ptrs['gw']}")
