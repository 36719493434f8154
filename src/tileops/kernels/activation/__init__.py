from .gated_activation import ACTIVATIONS, GatedActivationConfig, GatedActivationKernel

__all__ = ["ACTIVATIONS", "GatedActivationConfig", "GatedActivationKernel"]
