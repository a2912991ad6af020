from .linear import FrozenLinear, FrozenProduct

__all__ = ["FrozenLinear", "FrozenProduct"]
