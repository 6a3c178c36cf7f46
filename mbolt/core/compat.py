"""The one rule for whether a trace or a plan belongs to a model, applied before any work.

Another geometry (layers, experts, a trace routing a layer the model has no experts in, k above
the expert count) is an error naming the trace or plan: its numbers cannot be applied to this
model. The same geometry with another fingerprint is one warning: a trace of one quantisation
plans another quantisation of the same model well, but the user should know.
"""

from __future__ import annotations

from mbolt.core.errors import MboltError, warn
from mbolt.core.moe_map import MoeMap
from mbolt.core.plan import Plan
from mbolt.core.trace import Trace


def check_compatible(item: Trace | Plan, model: MoeMap, where: str) -> None:
    """Raise MboltError (naming `where`, the trace or plan file) unless `item` fits `model`."""
    kind = "trace" if isinstance(item, Trace) else "plan"
    if (item.n_layers, item.n_experts) != (model.n_layers, model.n_experts):
        raise MboltError(f"{where}: {kind} is for {item.n_layers} layers x {item.n_experts} experts, "
                         f"{model.path} has {model.n_layers} x {model.n_experts}")
    if isinstance(item, Trace):
        if item.k > model.n_experts:
            raise MboltError(f"{where}: k={item.k} exceeds the {model.n_experts} experts of {model.path}")
        moe = {layer.index for layer in model.moe_layers}
        stray = [layer for layer in item.moe_layers().tolist() if layer not in moe]
        if stray:
            raise MboltError(f"{where}: trace routes experts at layer {stray[0]}, which is not an MoE layer "
                             f"of {model.path}")
        fp = item.fingerprint
    else:
        fp = (item.meta or {}).get("fingerprint") or ""
    if fp and fp not in (model.fingerprint, model.source_fingerprint):
        warn(f"{where}: {kind} was recorded on a model with fingerprint {fp[:12]}, {model.path} comes from "
             f"{model.source_fingerprint[:12]} (fine for another quantisation of the same model)")
