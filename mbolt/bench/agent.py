"""The agent workload of scripts/bench_serve.py (issue 55): an agent's long prefix restored from
`mbolt serve --prompt-cache` after a restart, under a real memory limit.

An 8,000-token prefix of held-out text (the system prompt and tool schemas an agent resends), then
a 200-token user turn, then a 256-token reply (temperature 1, a fixed seed, `ignore_eos`), through
/v1/completions: the bench models have no chat template, so the whole prompt is what the cache
saves. Each server is a fresh process inside a memory cgroup of 40% of the file, started after the
model's and the cache's pages were dropped. Per round:
  cold          an empty cache directory: prefix + turn A evaluated (and saved);
  cold (A/A)    again, another empty directory, prefix + turn A;
  restored      a new server on the first directory: prefix + turn B, the prefix read from disk;
  restored (A/A) another new server on a copy of that directory taken before: prefix + turn B again
                (the restored turn saves its whole prompt, which a second B would restore);
  four clients  a new server with 4 slots on it: prefix + turns D-G at once; each reply's
                `cached_tokens` says whether it restored the prefix (none may evaluate it).
Each A/A's two servers run in alternating order, the A/A's first in odd rounds: a position in the
sequence counts as noise, not as a difference (run 3 compared turns B and C, two texts, and its
second cold server was the slower in 4 of 5 rounds).
Once per run, warm (no limit, the file in memory): prefix + turn A, then prefix + turn B on the
same slot, whose time to first token is the 200 new tokens' compute. The bound of a restore: the
cache file's bytes at the drive's sequential rate (bench.probe.sequential_read on the model file)
plus that warm compute.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from mbolt.bench.probe import sequential_read
from mbolt.bench.served import Served, log, log_errors
from mbolt.core.memlimit import MemoryGroup
from mbolt.core.pagecache import evict

PREFIX, TURN, REPLY, SEED, CLIENTS = 8000, 200, 256, 1234, 4
# every server's --prompt-cache-size: more than a round writes (at full depth, 48 layers, a prompt's
# KV file is about 0.8 GB and a round writes six to one directory), so no file is evicted mid-round;
# the default (a tenth of the free space) was about 1.5 GB beside the 19.4 GB full-depth file
CACHE_SIZE = "8G"
GOAL_KEYS = ("restored_over_cold_max", "restored_over_bound_max", "aa_within", "decode_within_aa")


def prompts(ids: list[int], prefix: int = PREFIX, turn: int = TURN) -> dict[str, list[int]]:
    """The prefix followed by each of seven user turns (A..G) of the text after it."""
    need = prefix + 7 * turn
    if len(ids) < need:
        raise SystemExit(f"the held-out text has {len(ids)} tokens; the agent workload needs {need}")
    return {c: ids[:prefix] + ids[prefix + i * turn: prefix + (i + 1) * turn] for i, c in enumerate("ABCDEFG")}


def _server(model: Path, ram: int | None, cache: Path, ctx: int, parallel: int = 1):
    """A server on `cache` (in a group of `ram` bytes, or warm: no limit, the file read into memory
    first), the model's and the cache's pages dropped before it starts."""
    evict(model)
    for f in cache.glob("*"):
        evict(f)
    if ram is None:
        subprocess.run(["cat", str(model)], stdout=subprocess.DEVNULL, check=True)
    stack = contextlib.ExitStack()
    g = stack.enter_context(MemoryGroup(ram)) if ram is not None else None
    try:
        srv = Served(model, False, g, ctx=ctx, parallel=parallel,
                     extra=("--prompt-cache", str(cache), "--prompt-cache-size", CACHE_SIZE))
    except BaseException:
        stack.close()
        raise
    return srv, g, stack


def _turns(model: Path, ram: int | None, cache: Path, ctx: int, ps: list[list[int]]) -> tuple[list[dict], list[str]]:
    """One server, these prompts one after the other; each reply's record (its usage says how many
    of its prompt tokens were not evaluated: `cached_tokens`)."""
    srv, g, stack = _server(model, ram, cache, ctx)
    out = []
    with stack:
        try:
            for p in ps:
                r = srv.turn(p, REPLY, SEED)
                r.pop("text")
                out.append(r)
        finally:
            err = srv.stop()
        if g is not None:
            out[-1]["oom_kills"] = g.oom_kills()
    return out, log_errors(err)


def _four_clients(model: Path, ram: int, cache: Path, ctx: int, ps: list[list[int]]) -> tuple[list[dict], list[str]]:
    srv, g, stack = _server(model, ram, cache, ctx, parallel=CLIENTS)  # -c is per slot
    rows: list[dict] = [{} for _ in ps]
    with stack:
        try:
            def client(i: int) -> None:
                r = srv.turn(ps[i], REPLY, SEED + i)
                r.pop("text")
                rows[i] = r

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stats = srv.metrics()
        finally:
            err = srv.stop()
    return [{**r, "server_cached_tokens_total": stats.get("cached_tokens")} for r in rows], log_errors(err)


def run(model: Path, ids: list[int], rounds: int, ram: int, prefix: int = PREFIX,
        four_rounds: int | None = None) -> dict:
    """The workload (module docstring) for `rounds` rounds, the four clients in the first
    `four_rounds` of them (None: every round); the figures and the raw rows."""
    ps = prompts(ids, prefix)
    ctx = prefix + TURN + REPLY + 64
    drive = sequential_read(model)
    log(f"  drive {drive['bytes_per_s'] / 1e9:.2f} GB/s sequential (cold); warm: prefix + A, then prefix + B")
    warm_dir = Path(tempfile.mkdtemp(prefix="agent-warm-"))
    try:
        warm, warm_err = _turns(model, None, warm_dir, ctx, [ps["A"], ps["B"]])
    finally:
        shutil.rmtree(warm_dir, ignore_errors=True)
    rows, errors = [], list(warm_err)
    for r in range(rounds):
        dirs = [Path(tempfile.mkdtemp(prefix="agent-cache-")) for _ in range(3)]
        one = lambda d, turn: _turns(model, ram, d, ctx, [ps[turn]])  # noqa: E731
        try:
            (cold, e1), (cold_aa, e2) = _pair(r, lambda: one(dirs[0], "A"), lambda: one(dirs[1], "A"))
            kv = sum(f.stat().st_size for f in dirs[0].glob("*.kv"))
            shutil.copytree(dirs[0], dirs[2], dirs_exist_ok=True)
            (restored, e3), (restored_aa, e4) = _pair(r, lambda: one(dirs[0], "B"), lambda: one(dirs[2], "B"))
            four, e5 = ([], []) if four_rounds is not None and r >= four_rounds else \
                _four_clients(model, ram, dirs[0], ctx, [ps[c] for c in "DEFG"])
        finally:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
        errors += e1 + e2 + e3 + e4 + e5
        row = {"round": r, "cold": cold[0], "cold_aa": cold_aa[0], "restored": restored[0],
               "restored_aa": restored_aa[0], "four_clients": four, "kv_bytes": kv}
        rows.append(row)
        log(f"  round {r + 1}: cold {cold[0]['ttft_s']:.2f} s ({cold_aa[0]['ttft_s']:.2f}), restored "
            f"{restored[0]['ttft_s']:.2f} s ({restored_aa[0]['ttft_s']:.2f}), cached "
            f"{restored[0]['cached_tokens']}/{prefix}; four clients {[round(x['ttft_s'], 2) for x in four]} s; "
            f"decode {cold[0]['decode_tokens_per_s']:.2f} -> {restored[0]['decode_tokens_per_s']:.2f} tok/s")
    return summarize(rows, warm, drive, prefix, errors)


def _pair(r: int, arm, arm_aa) -> tuple:
    """An A/A's two runs (`arm()`, `arm_aa()`), the A/A's first in odd rounds."""
    if r % 2:
        second = arm_aa()
        return arm(), second
    return arm(), arm_aa()


def summarize(rows: list[dict], warm: list[dict], drive: dict, prefix: int, errors: list[str]) -> dict:
    med = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    paired = lambda a, b, k="ttft_s": med([r[a][k] / r[b][k] for r in rows if r[a][k] and r[b][k]])  # noqa: E731
    kv = med([r["kv_bytes"] for r in rows])
    warm_200 = warm[1]["ttft_s"]
    bound = kv / drive["bytes_per_s"] + warm_200 if kv else None
    restored = med([r["restored"]["ttft_s"] for r in rows])
    fours = [c for r in rows for c in r["four_clients"]]
    four_restored = bool(fours) and all((c.get("cached_tokens") or 0) >= prefix for c in fours)
    return {"prefix_tokens": prefix, "turn_tokens": TURN, "reply_tokens": REPLY, "clients": CLIENTS,
            "drive": drive, "warm": warm, "warm_200_ttft_s": warm_200, "kv_bytes": kv, "bound_s": bound,
            "cold_ttft_s": med([r["cold"]["ttft_s"] for r in rows]), "restored_ttft_s": restored,
            "restored_over_cold": paired("restored", "cold"),
            "restored_over_bound": restored / bound if restored and bound else None,
            "aa": {"cold": paired("cold_aa", "cold"), "restored": paired("restored_aa", "restored")},
            "decode": {"cold": med([r["cold"]["decode_tokens_per_s"] for r in rows]),
                       "restored": med([r["restored"]["decode_tokens_per_s"] for r in rows]),
                       "restored_over_cold": paired("restored", "cold", "decode_tokens_per_s"),
                       "aa_cold": paired("cold_aa", "cold", "decode_tokens_per_s"),
                       "aa_restored": paired("restored_aa", "restored", "decode_tokens_per_s")},
            "restored_cached_tokens": [r["restored"]["cached_tokens"] for r in rows],
            "four_clients_all_restored": four_restored,
            "four_clients_ttft_s": [[c["ttft_s"] for c in r["four_clients"]] for r in rows],
            "oom_kills": sum(r[a].get("oom_kills", 0) or 0 for r in rows for a in ("cold", "cold_aa", "restored",
                                                                                   "restored_aa")),
            "log_errors": errors, "rounds": rows}


def goals(out: dict, pr) -> list[dict]:
    """The pre-registration's goals judged on `out` (summarize's)."""
    aa_vals = [v for v in (*out["aa"].values(), out["decode"]["aa_cold"], out["decode"]["aa_restored"]) if v]
    aa = max(abs(v - 1) for v in aa_vals) if aa_vals else None
    dec = out["decode"]["restored_over_cold"]
    g_cold, g_bound, g_aa = pr.goal("restored_over_cold_max"), pr.goal("restored_over_bound_max"), pr.goal("aa_within")
    return [
        {"goal": f"restored TTFT after a restart <= {g_cold}x cold", "value": out["restored_over_cold"],
         "met": out["restored_over_cold"] is not None and out["restored_over_cold"] <= g_cold},
        {"goal": f"restored TTFT <= {g_bound}x (KV bytes at the drive's rate + 200 tokens' warm compute)",
         "value": out["restored_over_bound"],
         "met": out["restored_over_bound"] is not None and out["restored_over_bound"] <= g_bound},
        {"goal": "four clients sharing the prefix all restore it", "value": out["four_clients_all_restored"],
         "met": out["four_clients_all_restored"]},
        {"goal": f"A/A within {g_aa:.0%} (TTFT and decode, cold and restored)", "value": aa,
         "met": aa is not None and aa <= g_aa},
        {"goal": "decode unchanged by the cache (restored over cold within the A/A)", "value": dec,
         "met": dec is not None and aa is not None and abs(dec - 1) <= max(aa, g_aa) and bool(pr.goal("decode_within_aa"))},
        {"goal": "no OOM kill, no error in any server's log", "value": {"oom_kills": out["oom_kills"],
                                                                      "errors": len(out["log_errors"])},
         "met": out["oom_kills"] == 0 and not out["log_errors"]},
    ]
