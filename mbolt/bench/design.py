"""The arm order of every round: blocks of a Williams square (every arm once in every position,
every ordered pair of arms adjacent equally often), arms relabelled and rows shuffled per block,
no arm twice in a row, across rounds too."""

from __future__ import annotations

import numpy as np

from mbolt.core.errors import MboltError

def williams_rows(n: int) -> list[list[int]]:
    """Williams' carry-over-balanced Latin square: every item once per position, and every ordered
    pair (a, b) adjacent equally often (n rows for even n, 2n for odd n)."""
    if n <= 2:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    for j in range(1, n):
        if j % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [r[::-1] for r in rows]
    return rows


def arm_orders(n_arms: int, n_rounds: int, seed: int = 0) -> list[list[int]]:
    """The arm order (indices) of each round: blocks of a Williams square with randomly relabelled
    arms and shuffled rows, so that no arm runs twice in a row, across round and block boundaries
    too. Seeded: the same (n_arms, seed) always gives the same sequence, and a longer run extends
    a shorter one (so adaptive stopping keeps the prefix)."""
    out: list[list[int]] = []
    gen = order_blocks(n_arms, seed)
    while len(out) < n_rounds:
        out += next(gen)
    return out[:n_rounds]


def order_blocks(n_arms: int, seed: int = 0):
    """Yield blocks (lists of rows) of `arm_orders`."""
    rng = np.random.default_rng(seed)
    base = williams_rows(n_arms)
    prev = None
    while True:
        if n_arms == 1:
            yield [[0]]
            continue
        if n_arms == 2:  # only A B A B ... avoids repeats: keep the orientation after the first
            row = [0, 1] if prev is None and rng.random() < 0.5 else [1, 0] if prev is None else \
                ([0, 1] if prev == 1 else [1, 0])
            prev = row[-1]
            yield [row]
            continue
        for _ in range(1000):
            sigma = rng.permutation(n_arms)
            rows = [[int(sigma[x]) for x in base[i]] for i in rng.permutation(len(base))]
            seq = [prev] + [x for r in rows for x in r]
            if all(a != b for a, b in zip(seq, seq[1:])):
                break
        else:  # pragma: no cover - a valid shuffle exists for n >= 3 and is found long before
            raise MboltError(f"could not draw an arm order without repeats for {n_arms} arms")
        prev = rows[-1][-1]
        yield rows


def design_block(n_arms: int) -> int:
    """Rounds per balanced block of `arm_orders`."""
    return len(williams_rows(n_arms)) if n_arms >= 3 else 1


def run_rounds(arms: list, rounds: int, seed: int, one_round, progress=None) -> tuple[list[dict], list[list[str]]]:
    """Every arm once per round, in the orders of `arm_orders`: `one_round(arm)` gives each
    arm-round's row (a dict; its round and position added here). (rows, each round's arm names);
    `progress(done, total, row)` after each."""
    rows: list[dict] = []
    orders = arm_orders(len(arms), rounds, seed)
    for rnd, order in enumerate(orders):
        for position, i in enumerate(order):
            r = one_round(arms[i])
            r.update(round=rnd, position=position)
            rows.append(r)
            if progress:
                progress(len(rows), len(orders) * len(arms), r)
    return rows, [[arms[i].name for i in o] for o in orders]
