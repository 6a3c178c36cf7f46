"""Reference engine: numpy MoE forward pass with llama.cpp parity (see engine/model.py)."""

from mbolt.engine.model import Model, Routing, load_model

__all__ = ["Model", "Routing", "load_model"]
