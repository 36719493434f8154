"""Checks shared by the softmax family's CPU-emulated kernel tests (the streaming walks, the
cluster kernels and the meeting slices): each runs a kernel through a `run(tensors)`
callback on NaN-filled outputs and compares with float64 torch."""

import torch

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


def check_forward(kind: str, x: torch.Tensor, run) -> None:
    """softmax, log_softmax or logsumexp of x's rows; `run` gets {x, y} or {x, out}."""
    if kind == "logsumexp":
        out = torch.full((x.shape[0],), float("nan"), dtype=x.dtype)
        run(dict(x=x, out=out))
        want = torch.logsumexp(x.double(), -1)
    else:
        out = torch.full_like(x, float("nan"))
        run(dict(x=x, y=out))
        want = getattr(torch, kind)(x.double(), -1)
    tol = TOL[x.dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * 1e-2, equal_nan=True)


def check_backward(kind: str, y: torch.Tensor, dy: torch.Tensor, run, rtol: float,
                   atol: float) -> None:
    """softmax_bwd (dx = y (dy - sum(dy y))) or log_softmax_bwd (dx = dy - e^y sum(dy));
    `run` gets {dy, y, dx}."""
    dx = torch.full_like(y, float("nan"))
    run(dict(dy=dy, y=y, dx=dx))
    yd, dyd = y.double(), dy.double()
    if kind == "softmax_bwd":
        want = yd * (dyd - (dyd * yd).sum(-1, keepdim=True))
    else:
        want = dyd - yd.exp() * dyd.sum(-1, keepdim=True)
    torch.testing.assert_close(dx.double(), want, rtol=rtol, atol=atol)
