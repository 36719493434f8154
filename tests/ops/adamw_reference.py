"""torch.optim.AdamW's update in float64: the reference of the AdamW op's tests."""

import math


def adamw_reference(param, grad, exp_avg, exp_avg_sq, *, lr, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=1e-2, step=1, maximize=False):
    """(param, exp_avg, exp_avg_sq) after one update, in float64."""
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    if maximize:
        g = -g
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    step_size = lr / (1.0 - beta1 ** step)
    p = p - step_size * m / (v.sqrt() / math.sqrt(1.0 - beta2 ** step) + eps)
    return p, m, v
