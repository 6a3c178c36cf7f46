"""Reference engine: numpy MoE forward pass with llama.cpp parity (see engine/model.py)."""

from mbolt.reference.arch import load_model
from mbolt.reference.model import Model, Routing

__all__ = ["Model", "Routing", "load_model"]
