"""Read merging: the one function that turns wanted byte ranges into reads.

The planner's evaluator, the predictor and the streaming engine all call this, so a layout is
scored exactly the way it is later read. Two ranges join into one read when the hole between
them is at most `gap` bytes (the reader reads through the hole); overlapping or touching ranges
always join. `split_jobs` cuts merged reads back into pieces when several threads read one call.
"""

from __future__ import annotations

import numpy as np


def merge_ranges_batched(starts: np.ndarray, ends: np.ndarray, gap: int = 0, valid: np.ndarray | None = None):
    """Merge each row of ranges independently.

    starts, ends: int64 [N, m] byte ranges [start, end); `valid` [N, m] masks padding.
    Returns (new_read [N, m] bool in sorted order, order [N, m], reads [N], bytes [N]) where
    `new_read[i, j]` says the j-th range of row i (after sorting by start) opens a new read.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if starts.ndim == 1:
        starts, ends = starts[None], ends[None]
        valid = None if valid is None else np.asarray(valid)[None]
    if valid is None:
        valid = np.ones(starts.shape, dtype=bool)
    # Padding sorts last and never opens a read.
    big = np.iinfo(np.int64).max // 4
    key = np.where(valid, starts, big)
    order = np.argsort(key, axis=1, kind="stable")
    s = np.take_along_axis(key, order, axis=1)
    e = np.take_along_axis(np.where(valid, ends, big), order, axis=1)
    v = np.take_along_axis(valid, order, axis=1)
    e_run = np.maximum.accumulate(e, axis=1)
    new = np.zeros(s.shape, dtype=bool)
    if s.shape[1]:
        new[:, 0] = v[:, 0]
        new[:, 1:] = v[:, 1:] & (s[:, 1:] > e_run[:, :-1] + gap)
    # Bytes actually read: a new read contributes its own length, a merged range extends the
    # current read to its end (holes it reads through included).
    prev = np.concatenate([np.zeros((s.shape[0], 1), np.int64), e_run[:, :-1]], axis=1)
    contrib = np.where(new, e_run - s, np.maximum(e_run - prev, 0))
    contrib = np.where(v, contrib, 0)
    return new, order, new.sum(axis=1), contrib.sum(axis=1)


def merge_ranges(starts, ends, gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Merge one set of ranges; returns the reads as (starts, ends), sorted."""
    starts = np.asarray(starts, dtype=np.int64).reshape(1, -1)
    ends = np.asarray(ends, dtype=np.int64).reshape(1, -1)
    if starts.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    new, order, _, _ = merge_ranges_batched(starts, ends, gap)
    s = starts[0, order[0]]
    e = np.maximum.accumulate(ends[0, order[0]])
    idx = np.flatnonzero(new[0])
    last = np.append(idx[1:] - 1, len(s) - 1)
    return s[idx], e[last]


SPLIT_MIN = 256 << 10  # never split a read into pieces smaller than this


def split_jobs(jobs, qd: int):
    """Split large reads `(offset, length, where)` so that `qd` threads have work: each read of a
    call becomes pieces of at least SPLIT_MIN bytes and at most total/qd (4 KiB-aligned), so one
    long merged run is not read by a single thread while the others idle."""
    total = sum(n for _, n, _ in jobs)
    piece = max(SPLIT_MIN, -(-total // qd))
    piece += (-piece) % 4096
    out = []
    for off, n, where in jobs:
        done = 0
        while n - done > piece:
            out.append((off + done, piece, where + done))
            done += piece
        out.append((off + done, n - done, where + done))
    return out
