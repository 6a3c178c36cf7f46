"""The bound beside every figure (DESIGN.md, "Measurement protocol"): what the machine allows.

Decode reads the experts its cache misses while it computes. With the reads overlapped with the
compute, a token takes at least the longer of the two, so

    tok/s bound = 1 / max(compute seconds per token, miss bytes per token / read bandwidth)

- compute: the warm time per token (file in memory, no limit: the compute alone);
- miss bytes: the fewest misses any cache of that size could have on the routing (Belady's MIN
  under the one cache rule, `replay.OptPolicy`) times the bytes of each missed expert;
- bandwidth: the drive's read bandwidth, sequential or random at the runtime's read size and
  queue depth (`mbolt probe`), or the throttle of a drive profile (`core.blkio`).

A measured tok/s is reported as its share of the bound. A share above 1 means an input is wrong
(e.g. the drive's reads were served from the host's cache), not that the bound was beaten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mbolt.core.errors import MboltError
from mbolt.core.trace import Trace


@dataclass(frozen=True)
class DecodeBound:
    compute_s: float  # per token
    io_s: float  # per token: miss bytes / bandwidth
    tok_s: float  # the bound
    limit: str  # "compute" or "io": which one sets it

    def share(self, tok_s: float) -> float:
        """A measured tok/s as a share of the bound."""
        if not tok_s >= 0 or not math.isfinite(tok_s):
            raise MboltError(f"measured tok/s must be a finite number >= 0, got {tok_s!r}")
        return tok_s / self.tok_s


def _finite(name: str, v: float, positive: bool = False) -> float:
    v = float(v)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise MboltError(f"decode bound: {name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    return v


def decode_bound(compute_s: float, miss_bytes: float, bandwidth: float) -> DecodeBound:
    """The tok/s the machine allows: `compute_s` seconds of compute per token, `miss_bytes` read
    per token at `bandwidth` bytes/s, reads overlapped with compute."""
    compute_s = _finite("compute seconds per token", compute_s)
    miss_bytes = _finite("miss bytes per token", miss_bytes)
    io_s = miss_bytes / _finite("read bandwidth (bytes/s)", bandwidth, positive=True)
    slowest = max(compute_s, io_s)
    if slowest == 0:
        raise MboltError("decode bound: compute time and miss bytes per token are both 0: nothing bounds tok/s")
    return DecodeBound(compute_s, io_s, 1.0 / slowest, "compute" if compute_s >= io_s else "io")


def miss_bytes_per_token(trace: Trace, slots: int, expert_bytes, prefilled: bool = False) -> float:
    """Bytes per token the best cache of `slots` experts per layer must read on `trace` (MIN under
    the one cache rule). `expert_bytes`: one expert's bytes (all of its tensors), a number or one
    per layer (mixed quantization types). `prefilled`: the cache starts holding the experts needed
    soonest (`OptPolicy`): the bound of a decode whose cache a prompt pass filled, which MIN from
    an empty cache overstates by its first fill (a 64-token decode measured 117% of such a bound)."""
    from mbolt.bench.replay import OptPolicy, replay

    try:
        per_layer = np.broadcast_to(np.asarray(expert_bytes, dtype=np.float64), (trace.n_layers,))
    except ValueError:
        raise MboltError(f"decode bound: expert bytes must be one number or one per layer ({trace.n_layers}), "
                         f"got {np.size(expert_bytes)}") from None
    if not (np.isfinite(per_layer).all() and (per_layer >= 0).all()):
        raise MboltError("decode bound: expert bytes must be finite numbers >= 0")
    if trace.n_tokens == 0:
        raise MboltError("decode bound: the trace has no tokens")
    opt = OptPolicy(trace.n_layers, slots, prefilled=prefilled)
    replay(trace, opt)
    return float((opt.misses * per_layer).sum() / trace.n_tokens)
