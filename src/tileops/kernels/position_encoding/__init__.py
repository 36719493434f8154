from .rotary import RotaryConfig, RotaryKernel

__all__ = ["RotaryConfig", "RotaryKernel"]
