"""bench_serve.py's concurrency workload (issue 34; scripts/bench_serve.py --workload concurrency) -> results/serve_concurrency_<model>.json.

For each client count (--clients, e.g. 1,2,4,8) and each server arm, a fresh server in a memory
cgroup of 40% of the file (the page cache charged to it; the file dropped first; 128 KiB
readahead; the group's peak reset once the server has loaded), and that many clients, each a
conversation of --turns turns (bench_serve's session: a 2,000-token first prompt, each turn + the
reply + 100 tokens of text, --reply tokens per reply, temperature 1 with a seed per client and
turn) through the official openai client. Arms:
  mbolt        `mbolt serve MODEL -np P` (P = the largest client count: every client has a slot)
  mbolt (A/A)  the same again, at one client (the denominator of the scaling goal)
  plain        `mbolt serve MODEL --plain -np P` (llama.cpp mapped; it batches the slots too)
  mbolt-np1    `mbolt serve MODEL -np 1` (one conversation at a time, the others queued)
Client texts: windows of the held-out text 500 tokens apart; the last client is the newcomer: it
starts once every other client's first reply is decoding, on the window a lone client gets, so its
time to first token compares with the lone client's.

Figures per run: total decode throughput = every reply's tokens after its first, over the wall time
in which at least one reply was decoding (the union of the [first token, last token] intervals: with
one client, its decode tok/s); the newcomer's time to first token; the group's peak after load;
every request answered (200) or refused (503), nothing else.
"""

from __future__ import annotations

import threading

import numpy as np

WINDOW = 500  # tokens between two clients' texts
ARMS = ("mbolt", "plain", "mbolt-np1")


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def decode_throughput(turns: list[dict]) -> float | None:
    spans = [(t["t_first"], t["t_end"]) for t in turns if t.get("t_first") is not None]
    tokens = sum(t["completion_tokens"] - 1 for t in turns if t.get("completion_tokens"))
    secs = union_seconds(spans)
    return tokens / secs if secs > 0 else None


def client_ids(ids: list[int], clients: int, need: int) -> list[list[int]]:
    """Client i's text: the window i*WINDOW on; the newcomer (the last) reads window 0, the lone
    client's."""
    if (clients - 1) * WINDOW + need > len(ids):
        raise SystemExit(f"the held-out text has {len(ids)} tokens; {clients} clients need "
                         f"{(clients - 1) * WINDOW + need}")
    order = list(range(1, clients)) + [0]
    return [ids[w * WINDOW:w * WINDOW + need] for w in order]


def run_clients(bs, model, arm: str, clients: int, parallel: int, ram: int, ids: list[int], turns: int,
                reply: int) -> dict:
    """One server arm, `clients` conversations (see the module docstring)."""
    import openai

    bs.evict(model)
    texts = client_ids(ids, clients, bs.FIRST + bs.APPEND * turns)
    slots = 1 if arm == "mbolt-np1" else parallel
    with bs.MemoryGroup(ram) as g:
        srv = bs.Served(model, arm == "plain", g, queue=8, parallel=slots)
        g.reset_peak()
        started = [threading.Event() for _ in range(clients)]
        results: list[dict] = [{} for _ in range(clients)]

        def client(i: int):
            rec = {"client": i, "newcomer": clients > 1 and i == clients - 1, "turns": [], "codes": []}
            try:
                if rec["newcomer"]:
                    for e in started[:-1]:
                        e.wait()
                rec["turns"] = bs.session(srv, texts[i], turns=turns, reply=reply, seed=bs.SEED + 100 * i,
                                          tag=f"{arm} c{i} ", first_done=started[i])
                rec["codes"] = [200] * len(rec["turns"])
            except openai.APIStatusError as e:
                rec["codes"].append(e.status_code)
            except Exception as e:  # noqa: BLE001 (a lost request is a finding, not a crash of the bench)
                rec["codes"].append(-1)
                rec["error"] = repr(e)
            finally:
                started[i].set()
                results[i] = rec

        seconds = bs.in_parallel(client, clients)
        try:
            stats = srv.metrics()
        finally:
            err = srv.stop()
        peak, kills = g.peak(), g.oom_kills()
    turns_all = [t for r in results for t in r["turns"]]
    codes = [c for r in results for c in r["codes"]]
    new = results[-1]["turns"][0]["ttft_s"] if clients > 1 and results[-1]["turns"] else None
    out = {"arm": arm, "clients": clients, "parallel": slots, "seconds": seconds,
           "decode_tokens_per_s_total": decode_throughput(turns_all),
           "first_ttft_s": results[0]["turns"][0]["ttft_s"] if clients == 1 and results[0]["turns"] else None,
           "newcomer_ttft_s": new, "requests": turns * clients, "answered": codes.count(200),
           "refused_503": codes.count(503), "other": [c for c in codes if c not in (200, 503)],
           "lost": turns * clients - codes.count(200) - codes.count(503),
           "peak_after_load_bytes": peak, "oom_kills": kills, "log_errors": bs.log_errors(err),
           "stats": {k: stats.get(k) for k in ("slots", "rows_per_step", "expert_union_per_step") if k in stats},
           "clients_detail": results}
    new_s = f", newcomer ttft {new:.2f} s" if new is not None else ""
    bs.log(f"  {arm} x{clients}: {out['decode_tokens_per_s_total'] or 0:.2f} tok/s total{new_s}, "
           f"peak {(peak or 0) / 2**20:.0f} MiB, lost {out['lost']}")
    return out


def plan_runs(clients: list[int]) -> list[tuple[str, int]]:
    """(arm, clients) in run order: client counts ascending, arms alternating in order between them;
    the A/A beside one client; mbolt-np1 only where a queue forms (2 clients or more)."""
    runs = []
    for k, c in enumerate(clients):
        arms = list(ARMS) if k % 2 == 0 else list(reversed(ARMS))
        arms = [a for a in arms if a != "mbolt-np1" or c > 1]
        if c == 1:
            arms.append("mbolt (A/A)")
        runs += [(a, c) for a in arms]
    return runs


def summarize(runs: list[dict], clients: list[int], pr, ram: int) -> dict:
    def get(arm, c):
        return next((r for r in runs if r["arm"] == arm and r["clients"] == c), None)

    tput = {arm: {str(c): (get(arm, c) or {}).get("decode_tokens_per_s_total") for c in clients}
            for arm in (*ARMS, "mbolt (A/A)")}
    one = tput["mbolt"].get("1")
    scaling = {str(c): (tput["mbolt"][str(c)] / one if one and tput["mbolt"][str(c)] else None) for c in clients}
    over_plain = {str(c): (tput["mbolt"][str(c)] / tput["plain"][str(c)]
                           if tput["mbolt"][str(c)] and tput["plain"][str(c)] else None) for c in clients}
    over_np1 = {str(c): (tput["mbolt"][str(c)] / tput["mbolt-np1"][str(c)]
                         if tput["mbolt"][str(c)] and tput["mbolt-np1"][str(c)] else None) for c in clients if c > 1}
    aa = tput["mbolt (A/A)"].get("1")
    aa_dev = abs(aa / one - 1.0) if aa and one else None
    alone = (get("mbolt", 1) or {}).get("first_ttft_s")
    top = max(clients)
    newcomer = (get("mbolt", top) or {}).get("newcomer_ttft_s")
    new_ratio = newcomer / alone if newcomer and alone else None
    mb = [r for r in runs if r["arm"].startswith("mbolt")]
    peak = max((r["peak_after_load_bytes"] or 0) for r in mb) if mb else None
    lost = sum(r["lost"] + len(r["other"]) for r in runs)
    g_scale, g_plain = pr.goal("throughput_4_over_1_min"), pr.goal("over_plain_min")
    g_new, g_aa = pr.goal("newcomer_ttft_over_alone_max"), pr.goal("aa_within")
    four = scaling.get("4")
    worst_plain = min((v for v in over_plain.values() if v is not None), default=None)
    goals = [
        {"goal": f"total decode throughput at 4 clients >= {g_scale}x one client's (mbolt)", "value": four,
         "met": four is not None and four >= g_scale},
        {"goal": f"mbolt >= {g_plain}x plain at every client count", "value": worst_plain,
         "met": worst_plain is not None and worst_plain >= g_plain and None not in over_plain.values()},
        {"goal": f"a newcomer's time to first token while {top - 1} others decode <= {g_new}x its time alone",
         "value": new_ratio, "met": new_ratio is not None and new_ratio <= g_new},
        {"goal": "memory under the budget throughout (mbolt's group peak after load)", "value": peak,
         "met": peak is not None and peak <= ram and not any(r["oom_kills"] for r in mb)},
        {"goal": "no request lost (every one answered or refused with 503)", "value": lost, "met": lost == 0},
        {"goal": f"A/A within {g_aa:.0%} (mbolt, one client)", "value": aa_dev,
         "met": aa_dev is not None and aa_dev <= g_aa},
    ]
    return {"decode_tokens_per_s_total": tput, "scaling_over_one_client": scaling, "mbolt_over_plain": over_plain,
            "mbolt_over_np1": over_np1, "aa_deviation": aa_dev, "alone_ttft_s": alone, "newcomer_ttft_s": newcomer,
            "newcomer_over_alone": new_ratio, "mbolt_peak_after_load_bytes_max": peak, "lost": lost,
            "median_seconds_per_run": float(np.median([r["seconds"] for r in runs])) if runs else None,
            "goals": goals}


GOAL_KEYS = ("throughput_4_over_1_min", "over_plain_min", "newcomer_ttft_over_alone_max", "aa_within")
