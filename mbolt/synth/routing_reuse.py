"""Expert reuse from token to token: what `synth --routing-like` fits the window head of
gguf/routing_fit.py to (a `ReuseTarget`, measured on a real trace), and the statistics it is
measured by on simulated selections.

The target's figures are per-layer means over a real trace's decode tokens: LRU hit rates of one
slot cache per layer (core/lru.SlotLru), each `window`-token passage from a cold cache, and the
consecutive overlap |S_t & S_t+1| / k. mbolt/data/reuse_qwen3-30b-a3b.json holds BigMoeOnEdge's
Qwen3-30B-A3B figures (the default of a profile, which has no token order of its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from mbolt.core.errors import MboltError


def consecutive_overlap(sel: np.ndarray, seq: np.ndarray, E: int) -> float | None:
    """Mean |S_t & S_t+1| / k over neighbours of the same sequence (None: no neighbours)."""
    n, k = sel.shape
    x = np.zeros((n, E), bool)
    x[np.arange(n)[:, None], sel] = True
    same = seq[1:] == seq[:-1]
    return float((x[1:] & x[:-1]).sum(axis=1)[same].mean() / k) if same.any() else None


@dataclass(frozen=True)
class ReuseTarget:
    """How a real model reuses experts from token to token, in its own geometry: per-layer LRU
    hit rates at `slots` (each `window`-token passage from a cold cache) and consecutive overlap
    (of k), at top-`k` of `n_experts`. Models of another k are fitted at top-`k` of their own
    router (the same reuse, their own k); of another expert count, to the overlap alone (slot
    counts of 128 experts say nothing of 512: at the same slots q72's fit reached 0.67 / 0.71 / 0.73
    with its overlap at 0.49, the compromise of a curve it cannot have)."""

    source: str
    k: int
    n_experts: int
    window: int
    slots: tuple[int, ...]
    lru_hits: tuple[float, ...]
    overlap: float


def load_reuse(path) -> ReuseTarget:
    """A ReuseTarget from its JSON (mbolt/data/reuse_*.json): the fields above."""
    try:
        d = json.loads(open(path).read())
        return ReuseTarget(str(d["source"]), int(d["k"]), int(d["n_experts"]), int(d["window"]),
                           tuple(int(x) for x in d["slots"]), tuple(float(x) for x in d["lru_hits"]),
                           float(d["overlap"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MboltError(f"{path}: not a reuse target ({e})") from None


def window_starts(seq: np.ndarray, window: int) -> np.ndarray:
    """First token of every whole `window`-token passage of each sequence (back to back)."""
    edges = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1], True])
    return np.array([a for s, e in zip(edges[:-1], edges[1:]) for a in range(s, e - window + 1, window)], np.int64)


def lru_hit_rates(sel: np.ndarray, starts: np.ndarray, window: int, slots) -> np.ndarray:
    """[len(slots)] hit rates of one slot LRU (core/lru.SlotLru: a token's experts checked against
    the cache as it stood, then made most recent in order) over each passage from a cold cache.
    All passages and slot counts at once: an expert is cached at c slots while fewer than c
    others were used after it (LRU's stack property)."""
    k, E = sel.shape[1], int(sel.max()) + 1
    last = np.full((len(starts), E), -1, np.int64)
    slots = np.asarray(slots)
    hits = np.zeros(len(slots))
    for t in range(window):
        now = sel[starts + t]  # [W, k]
        mine = np.take_along_axis(last, now, axis=1)
        newer = (last[:, None, :] > mine[:, :, None]).sum(axis=2)
        hits += ((mine >= 0)[..., None] & (newer[..., None] < slots)).sum(axis=(0, 1))
        np.put_along_axis(last, now, t * k + np.arange(k)[None, :], axis=1)
    return hits / (len(starts) * window * k)


def reuse_stats(sel: np.ndarray, seq: np.ndarray, E: int, target: ReuseTarget, starts: np.ndarray) -> dict:
    """A layer's LRU hits and consecutive overlap, of its selections [N, target.k]."""
    return {"lru_hits": lru_hit_rates(sel, starts, target.window, target.slots).tolist(),
            "overlap": consecutive_overlap(sel, seq, E)}


def reuse_error(st: dict, target: ReuseTarget, n_experts: int) -> float:
    """Mean log ratio of the reached statistics to the target's (LRU hits, then overlap; the
    overlap alone for a model of another expert count)."""
    same = n_experts == target.n_experts
    got = (list(st["lru_hits"]) if same else []) + [st["overlap"]]
    want = (list(target.lru_hits) if same else []) + [target.overlap]
    return float(np.mean(np.log(np.maximum(got, 1e-6) / np.asarray(want))))


def mean_reuse(stats: list[dict]) -> dict:
    return {"lru_hits": np.mean([s["lru_hits"] for s in stats], axis=0).tolist(),
            "overlap": float(np.mean([s["overlap"] for s in stats]))}
