"""TileLang kernels, one package per operator family."""

from .base import SM90A, Kernel, target_for_device

__all__ = ["SM90A", "Kernel", "target_for_device"]
