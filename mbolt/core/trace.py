"""The in-memory trace: which experts every token routed to, at every layer.

This dataclass is the contract between the tracer/importers (which produce it) and the
planner, predictor and cache replay (which consume it). The on-disk `.mbtrace` format lives in
`mbolt/core/mbtrace.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mbolt.core.errors import MboltError

PREFILL = 0
DECODE = 1
PHASES = {"decode": DECODE, "prefill": PREFILL}
MIN_TRAIN_TOKENS = 2


@dataclass
class Trace:
    n_layers: int  # layers in the model (MoE or not); dense layers are all -1
    n_experts: int
    k: int  # experts used per token
    experts: np.ndarray  # int16 [N, n_layers, k], rank order; -1 where not recorded / dense
    phase: np.ndarray  # uint8 [N]: PREFILL or DECODE
    seq: np.ndarray  # int32 [N]: sequence (prompt) id
    pos: np.ndarray  # int32 [N]: token position within its sequence
    weights: np.ndarray | None = None  # float32 [N, n_layers, k] routing weights, optional
    domains: dict[int, str] = field(default_factory=dict)  # seq id -> domain tag
    fingerprint: str = ""  # source model fingerprint (hex), "" when unknown (imports)
    notes: list[str] = field(default_factory=list)  # what importers dropped or flagged

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    def select(self, mask: np.ndarray) -> "Trace":
        """The sub-trace of the tokens where `mask` is true (same header)."""
        return Trace(
            self.n_layers, self.n_experts, self.k, self.experts[mask], self.phase[mask],
            self.seq[mask], self.pos[mask],
            None if self.weights is None else self.weights[mask],
            dict(self.domains), self.fingerprint, list(self.notes),
        )

    def moe_layers(self) -> np.ndarray:
        """Indices of layers where at least one token has a recorded routing."""
        return np.flatnonzero((self.experts >= 0).any(axis=(0, 2)))


def select_phase(trace: Trace, phase: str, where: str = "trace") -> Trace:
    """The tokens of one phase ("decode", "prefill") or all of them ("all"); `where` names the
    trace in messages."""
    if phase == "all":
        return trace
    if phase not in PHASES:
        raise MboltError(f"unknown phase {phase!r} (decode, prefill, all)")
    if trace.n_tokens == 0:
        raise MboltError(f"{where} has no tokens")
    sub = trace.select(np.asarray(trace.phase) == PHASES[phase])
    if sub.n_tokens == 0:
        hint = " (--phase all counts its prefill tokens)" if phase == "decode" else ""
        raise MboltError(f"{where} has no {phase} tokens{hint}")
    return sub


def split_trace(trace: Trace, *, train_frac: float = 0.5, holdout_domain: str | None = None,
                phase: str = "decode") -> tuple[Trace, Trace | None, dict]:
    """(training, held-out or None, description): the one train/held-out split of every command.

    Tokens in trace order, phase filter first; the first floor(N * train_frac) tokens train, or
    the sequences of `holdout_domain` are held out."""
    if trace.n_tokens == 0:
        raise MboltError("trace has no tokens")
    trace = select_phase(trace, phase)
    N = trace.n_tokens
    if holdout_domain is not None:
        # a domain matches exactly or as a family prefix: "dolly" holds out "dolly/open_qa" too
        held_seqs = [s for s, tag in trace.domains.items()
                     if tag == holdout_domain or tag.startswith(holdout_domain.rstrip("/") + "/")]
        held = np.isin(trace.seq, held_seqs)
        if not held.any():
            known = sorted(set(trace.domains.values()))
            which = "decode tokens" if phase == "decode" else "tokens"
            raise MboltError(f"no {which} in domain {holdout_domain!r} (trace domains: {known or 'none'})")
        if held.all():
            raise MboltError(f"every token is in domain {holdout_domain!r}: nothing left to train on")
        info = {"by": "domain", "holdout_domain": holdout_domain}
    else:
        if not 0.0 < train_frac <= 1.0:
            raise MboltError(f"--train-frac must be in (0, 1], got {train_frac}")
        n_train = int(np.floor(N * train_frac + 1e-9))
        held = np.arange(N) >= n_train
        if train_frac < 1.0 and (n_train < MIN_TRAIN_TOKENS or not held.any()):
            raise MboltError(f"trace has {N} {phase} tokens: too few for a {train_frac:g} train/held-out split")
        info = {"by": "fraction", "train_frac": float(train_frac)}
    train = trace.select(~held)
    if train.n_tokens < MIN_TRAIN_TOKENS:
        raise MboltError(f"only {train.n_tokens} training token(s): too few to plan")
    info.update(phase=phase, n_train=train.n_tokens, n_heldout=int(held.sum()))
    return train, (trace.select(held) if held.any() else None), info


def merge_traces(traces: list[Trace], names: list[str] | None = None) -> Trace:
    """One trace from traces of the same model (e.g. `mbolt trace --shard I/N` on many machines).

    Refuses traces of other geometry (layers, experts, k) or of another model (fingerprints
    differ; an empty fingerprint, from an import, matches any). Sequences are renumbered so
    that each trace's keep their own ids (trace i's sequences follow trace i-1's), domains
    follow their sequences; routing weights are kept only if every trace has them."""
    if not traces:
        raise MboltError("no traces to merge")
    names = names or [f"trace {i + 1}" for i in range(len(traces))]
    first = traces[0]
    fps = {t.fingerprint for t in traces if t.fingerprint}
    for t, name in zip(traces, names):
        if (t.n_layers, t.n_experts, t.k) != (first.n_layers, first.n_experts, first.k):
            raise MboltError(f"{name}: {t.n_layers} layers x {t.n_experts} experts, k={t.k}; {names[0]} has "
                             f"{first.n_layers} x {first.n_experts}, k={first.k}: not the same model")
    if len(fps) > 1:
        known = [(t.fingerprint, n) for t, n in zip(traces, names) if t.fingerprint]
        (fa, na), (fb, nb) = known[0], next(x for x in known if x[0] != known[0][0])
        raise MboltError(f"{nb}: recorded on model {fb[:12]}, {na} on {fa[:12]}: not the same model")
    seqs, domains, notes = [], {}, []
    base = 0
    for t, name in zip(traces, names):
        s = np.asarray(t.seq, np.int64)
        seqs.append(s + base)
        for k, v in t.domains.items():
            domains[int(k) + base] = v
        notes += [f"{name}: {n}" for n in t.notes]
        base += int(max(s.max(initial=-1), max(t.domains, default=-1))) + 1
    if base > np.iinfo(np.int32).max:
        raise MboltError(f"merged trace has {base} sequences: too many")
    weights = None
    if all(t.weights is not None for t in traces):
        weights = np.concatenate([t.weights for t in traces])
    return Trace(first.n_layers, first.n_experts, first.k,
                 np.concatenate([t.experts for t in traces]), np.concatenate([t.phase for t in traces]),
                 np.concatenate(seqs).astype(np.int32), np.concatenate([t.pos for t in traces]), weights,
                 domains, next(iter(fps), ""), notes)
