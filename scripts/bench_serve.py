"""`mbolt serve` under a real memory limit, through the official openai client -> results/serve_<model>.json.

Each server is a fresh process inside a memory cgroup of 40% of the file (the page cache is charged
to it), started after the model's pages were dropped, at --readahead KiB (default 128, llama.cpp as
shipped; the pre-registration names plain's best window when it runs there); the group's peak is
reset once the server has loaded. Arms:
  mbolt   `mbolt serve MODEL` (the streaming runtime, budget from the cgroup)
  plain   `mbolt serve MODEL --plain` (llama.cpp mapped, repacking off, no callback: the same server) at
          -ub 512 and -ub 2048 (plain-512, plain-2048); plain's figures are its better micro-batch per turn
  warm    `mbolt serve MODEL --plain` without a limit, the file in memory (the compute alone)

A client session of 4 turns on /v1/completions (the bench models have no chat template): a first
prompt of 2,000 tokens of real text, then each turn appends the reply and 100 more tokens of the
text (the KV cache of the conversation is reused), 256 tokens per reply, sampled at temperature 1
with a fixed seed (greedy decoding of synthetic weights repeats a few tokens, and then every
expert stays cached and nothing is measured; the same seed gives every arm the same tokens).
Per turn, timed by the client the same way in every arm: time to first token (request sent to the
first streamed event carrying a token), decode tok/s after it ((tokens - 1) / the rest of the wall
time), the tokens the server says it generated (usage: a reply must be exactly 256; an overrun is
reported, never hidden).

Then a load run on mbolt: 8 concurrent clients x 4 requests (200-token prompts, 64-token replies),
a queue bound of 4: every request answered or refused with 503, no OOM kill, the group's peak after
the load under the budget, no error in the server's log.

  python scripts/bench_serve.py [--model q864] [--rounds 1]     (models from bench_memlimit.py prepare)

Goals are read from the pre-registration (--prereg, default prereg/serve.toml: [goals]
decode_over_plain_min, first_ttft_over_warm_max), which must be committed and locked, the tree clean
outside results/ and prereg/ (bench.prereg); the result records the revision, the machine and the
load average. --dry-run checks that and prints the plan.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mbolt.bench.prereg import run_record, write_result  # noqa: E402
from mbolt.bench.served import Served, bench_model, gate, in_parallel, log, log_errors  # noqa: E402,F401
from mbolt.core.memlimit import MemoryGroup, readahead  # noqa: E402
from mbolt.core.pagecache import evict  # noqa: E402

FIRST, APPEND, REPLY, TURNS = 2000, 100, 256, 4
LOAD_CLIENTS, LOAD_REQUESTS, LOAD_PROMPT, LOAD_REPLY, LOAD_QUEUE = 8, 4, 200, 64, 4
SEED = 1234
PLAIN_UBATCH = (512, 2048)  # plain at its better micro-batch: both run, the better taken per turn
GOAL_KEYS = ("decode_over_plain_min", "first_ttft_over_warm_max")


def session_text_ids(model: Path, tokens: int = 0) -> list[int]:
    """The held-out text: enough for the session and the load run, and at least `tokens` tokens
    (the concurrency workload's client windows)."""
    from mbolt.bench.ab import load_prompt_ids

    session = FIRST + APPEND * TURNS
    return load_prompt_ids(str(model), None, 1, engine="llama.cpp", forced=FIRST, n_new=APPEND * TURNS,
                           followup=max(LOAD_PROMPT * LOAD_CLIENTS, tokens - session))[0]


def session(srv: Served, ids: list[int], turns: int = TURNS, reply: int = REPLY, seed: int = SEED,
            tag: str = "", first_done: threading.Event | None = None) -> list[dict]:
    """`turns` turns: the conversation grows by the reply (its text, tokenized as a client's history
    would be) and 100 more tokens of the text. `first_done` is set once the first reply is
    decoding (its first token arrived)."""
    from mbolt.runtime.runner import LlamaRunner

    out, ctx, pos = [], list(ids[:FIRST]), FIRST
    with LlamaRunner(srv.model, vocab_only=True) as v:
        for t in range(turns):
            r = srv.turn(ctx, reply, seed + t, on_first=first_done if t == 0 else None)
            log(f"    {tag}turn {t + 1}: prompt {len(ctx)} tokens, ttft {r['ttft_s'] or 0:.2f} s, "
                f"{r['decode_tokens_per_s'] or 0:.2f} tok/s")
            out.append({k: v_ for k, v_ in r.items() if k != "text"})
            ctx = ctx + v.tokenize(r["text"]) + list(ids[pos:pos + APPEND])
            pos += APPEND
    return out


def load_run(srv: Served, ids: list[int]) -> dict:
    codes, errors = [], []
    lock = threading.Lock()

    def client(i: int):
        import openai

        for j in range(LOAD_REQUESTS):
            off = FIRST + APPEND * TURNS + LOAD_PROMPT * ((i + j) % LOAD_CLIENTS)
            try:
                srv.client.completions.create(model="m", prompt=ids[off:off + LOAD_PROMPT], max_tokens=LOAD_REPLY,
                                              temperature=1.0, seed=i * 100 + j)
                code = 200
            except openai.APIStatusError as e:
                code = e.status_code
            except Exception as e:  # noqa: BLE001 (a dropped connection is a finding, not a crash of the bench)
                code = -1
                errors.append(repr(e))
            with lock:
                codes.append(code)

    seconds = in_parallel(client, LOAD_CLIENTS)
    return {"clients": LOAD_CLIENTS, "requests_each": LOAD_REQUESTS, "queue_bound": LOAD_QUEUE,
            "answered": codes.count(200), "refused_503": codes.count(503),
            "other": [c for c in codes if c not in (200, 503)], "client_errors": errors, "seconds": seconds}


def run_arm(model: Path, mode: str, ram: int, ids: list[int], with_load: bool = False) -> dict:
    evict(model)
    if mode == "warm":
        subprocess.run(["cat", str(model)], stdout=subprocess.DEVNULL, check=True)
        srv = Served(model, True, None)
        try:
            turns = session(srv, ids)
        finally:
            err = srv.stop()
        return {"mode": mode, "load_s": srv.load_s, "turns": turns, "log_errors": log_errors(err)}
    with MemoryGroup(ram) as g:
        plain = mode.startswith("plain")
        srv = Served(model, plain, g, queue=LOAD_QUEUE if with_load else 8, ubatch=int(mode.split("-")[1]) if plain else 0)
        g.reset_peak()  # the load touched the whole group: what follows counts
        try:
            turns = session(srv, ids)
            stats = srv.metrics()
            load = load_run(srv, ids) if with_load else None
        finally:
            err = srv.stop()
        out = {"mode": mode, "load_s": srv.load_s, "turns": turns, "stats": stats, "peak_after_load_bytes": g.peak(),
               "oom_kills": g.oom_kills(), "log_errors": log_errors(err)}
        if load is not None:
            out["load"] = load
        return out


PLAIN_ARMS = tuple(f"plain-{ub}" for ub in PLAIN_UBATCH)
ARMS = ("warm", *PLAIN_ARMS, "mbolt")


def per_turn_rows(rounds: list[dict]) -> list[dict]:
    """Per turn: medians over rounds of each arm's client-timed TTFT and decode tok/s; plain is its
    better micro-batch (the better plain arm of the turn, by median); the ratios are paired: per
    round, mbolt over that plain arm (and over warm) in the same round, then the median."""
    med = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    out = []
    for t in range(len(rounds[0]["arms"]["mbolt"]["turns"])):
        def vals(mode, key):
            return [rd["arms"][mode]["turns"][t][key] for rd in rounds if rd["arms"][mode]["turns"][t][key] is not None]

        def paired(a, b, key):
            xs = [rd["arms"][a]["turns"][t][key] / rd["arms"][b]["turns"][t][key] for rd in rounds
                  if rd["arms"][a]["turns"][t][key] is not None and rd["arms"][b]["turns"][t][key]]
            return med(xs)

        row = {"turn": t + 1}
        for mode in ARMS:
            row[f"{mode}_ttft_s"] = med(vals(mode, "ttft_s"))
            row[f"{mode}_decode_tokens_per_s"] = med(vals(mode, "decode_tokens_per_s"))
        dec_arm = max(PLAIN_ARMS, key=lambda m: row[f"{m}_decode_tokens_per_s"] or 0.0)
        ttft_arm = min(PLAIN_ARMS, key=lambda m: row[f"{m}_ttft_s"] or float("inf"))
        row.update({"plain_decode_arm": dec_arm, "plain_ttft_arm": ttft_arm,
                    "plain_decode_tokens_per_s": row[f"{dec_arm}_decode_tokens_per_s"],
                    "plain_ttft_s": row[f"{ttft_arm}_ttft_s"],
                    "decode_over_plain": paired("mbolt", dec_arm, "decode_tokens_per_s"),
                    "ttft_over_plain": paired("mbolt", ttft_arm, "ttft_s"),
                    "ttft_over_warm": paired("mbolt", "warm", "ttft_s")})
        out.append(row)
    return out


def reply_lengths(rounds: list[dict]) -> dict:
    """Every reply's token count from the server's usage: a reply is exactly REPLY tokens, and an
    overrun (llama-cpp-python's multibyte path can pass max_tokens) is reported with where it was."""
    off = [{"round": k, "arm": mode, "turn": i + 1, "completion_tokens": t["completion_tokens"]}
           for k, rd in enumerate(rounds) for mode, arm in rd["arms"].items() for i, t in enumerate(arm["turns"])
           if t["completion_tokens"] != t["max_tokens"]]
    return {"max_tokens": REPLY, "all_exact": not off, "not_exact": off}


# ---- what every workload does the same way: its pre-registration, the result's head, the write ----


def workload_prereg(a, default: str) -> Path:
    """The workload's own pre-registration unless --prereg names another than the session's."""
    return ROOT / "prereg" / default if a.prereg == ROOT / "prereg" / "serve.toml" else a.prereg


def start_run(a, prereg: Path, goal_keys, dst: Path, plan: str):
    """The pre-registration checked (`gate`); with --dry-run the plan printed and None, else
    (pr, the run's record, the model, its size, the 40% budget)."""
    pr, lock = gate(prereg, goal_keys, dst, a.dry_run)
    if a.dry_run:
        print(f"pre-registration {pr.path}: committed, locked, tree clean, goals present; {plan}")
        return None
    model, size, ram = bench_model(a.model)
    return pr, run_record(pr, lock, ROOT, model), model, size, ram


def result_head(benchmark: str, script: str, a, size: int, ram: int, readahead_kb: int) -> dict:
    return {"benchmark": benchmark, "script": script, "model": a.model, "file_bytes": size, "budget_bytes": ram,
            "budget_frac": 0.4, "readahead_kb": readahead_kb}


def finish_run(pr, rec: dict, dst: Path, out: dict) -> None:
    """The result written with its record (bench.prereg.write_result), its goals logged."""
    write_result(pr, rec, dst, out, default=float)
    log("wrote", dst)
    for goal in out["goals"]:
        log(f"  {goal['goal']}: {goal['value']}: {'met' if goal['met'] else 'MISSED'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="q864")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prereg", type=Path, default=ROOT / "prereg" / "serve.toml")
    ap.add_argument("--dry-run", action="store_true", help="check the pre-registration and print the plan")
    ap.add_argument("--workload", choices=("session", "concurrency", "agent"), default="session",
                    help="session: the 4-turn session against plain and warm; concurrency: 1..N clients at once "
                         "(mbolt/bench/serve_concurrency.py; default --prereg prereg/serve_concurrency.toml); agent: an "
                         "8,000-token prefix restored from --prompt-cache after a restart (bench.agent; default "
                         "--prereg prereg/serve_agent.toml)")
    ap.add_argument("--clients", default="1,2,4,8", help="concurrency: the client counts")
    ap.add_argument("--turns", type=int, default=TURNS, help="concurrency: turns per conversation")
    ap.add_argument("--reply", type=int, default=REPLY, help="concurrency: tokens per reply")
    ap.add_argument("--four-clients-rounds", type=int, default=None, metavar="N",
                    help="agent: the four clients in the first N rounds only (default: every round)")
    ap.add_argument("--readahead", type=int, default=128, metavar="KB",
                    help="the drive's read_ahead_kb for every arm, restored after (default 128: as shipped; "
                         "plain's best window from bench_memlimit.py's sweep when the pre-registration says so)")
    a = ap.parse_args()
    if not 4 <= a.readahead <= 65536:
        ap.error(f"--readahead {a.readahead}: give a window in KiB from 4 to 65536")
    if a.four_clients_rounds is not None and a.four_clients_rounds < 1:
        ap.error(f"--four-clients-rounds {a.four_clients_rounds}: give 1 or more (the goal needs the four clients)")
    if a.workload == "concurrency":
        return concurrency(a)
    if a.workload == "agent":
        return agent(a)
    dst = ROOT / "results" / f"serve_{a.model}.json"
    run = start_run(a, a.prereg, GOAL_KEYS, dst, f"{a.rounds} round(s) of {', '.join(ARMS)} ({TURNS} turns, "
                    f"{REPLY} tokens per reply, TTFT timed by the client, readahead {a.readahead} KiB)")
    if run is None:
        return
    pr, rec, model, size, ram = run
    ids = session_text_ids(model)
    rounds = []
    with readahead(model, a.readahead) as ra:
        for r in range(a.rounds):
            order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
            arms = {}
            for mode in order:
                log(f"round {r + 1}: {mode}")
                arms[mode] = run_arm(model, mode, ram, ids, with_load=(mode == "mbolt"))
            rounds.append({"order": order, "arms": arms})
    per_turn = per_turn_rows(rounds)
    texts = {mode: [x["text_sha256"] for rd in rounds for x in rd["arms"][mode]["turns"]] for mode in ARMS}
    same = all(texts[m] == texts["mbolt"] for m in ARMS)
    mb = [rd["arms"]["mbolt"] for rd in rounds]
    load = [m["load"] for m in mb]
    out = {**result_head("mbolt serve under a real memory limit (issues 27, 33)", "scripts/bench_serve.py", a, size,
                         ram, ra),
           "session": {"first_prompt": FIRST, "append_per_turn": APPEND, "reply": REPLY, "turns": TURNS,
                       "sampling": "temperature 1, top_k 0, top_p 1, min_p 0, seed per turn",
                       "timing": "client: request to the first streamed token event; decode = (tokens - 1) / the rest",
                       "plain": f"the better of {', '.join(PLAIN_ARMS)} per turn"},
           "per_turn": per_turn, "same_tokens": same, "reply_lengths": reply_lengths(rounds), "rounds": rounds,
           "load": load, "peak_after_load_bytes_max": max(m["peak_after_load_bytes"] or 0 for m in mb),
           "oom_kills": sum(rd["arms"][m]["oom_kills"] for rd in rounds for m in ARMS if m != "warm")}
    dec_min = min((r["decode_over_plain"] for r in per_turn if r["decode_over_plain"] is not None), default=None)
    g_dec, g_ttft = pr.goal("decode_over_plain_min"), pr.goal("first_ttft_over_warm_max")
    out["goals"] = [
        {"goal": f"decode >= {g_dec}x plain (its better micro-batch) in every turn", "value": dec_min,
         "met": dec_min is not None and dec_min >= g_dec},
        {"goal": f"first TTFT <= {g_ttft}x warm (client-timed)", "value": per_turn[0]["ttft_over_warm"],
         "met": per_turn[0]["ttft_over_warm"] is not None and per_turn[0]["ttft_over_warm"] <= g_ttft},
        {"goal": "the same tokens in every arm", "value": same, "met": bool(same)},
        {"goal": f"every reply exactly {REPLY} tokens (usage)", "value": len(out["reply_lengths"]["not_exact"]),
         "met": out["reply_lengths"]["all_exact"]},
        {"goal": "load run: every request answered or refused with 503, no OOM kill, peak under the budget, "
                 "no error in the log",
         "value": {"answered": sum(x["answered"] for x in load), "refused": sum(x["refused_503"] for x in load),
                   "other": sum(len(x["other"]) for x in load), "peak": out["peak_after_load_bytes_max"]},
         "met": all(not x["other"] and x["answered"] + x["refused_503"] == LOAD_CLIENTS * LOAD_REQUESTS for x in load)
         and out["oom_kills"] == 0 and out["peak_after_load_bytes_max"] <= ram
         and not any(m["log_errors"] for m in mb)},
    ]
    finish_run(pr, rec, dst, out)
    for x in out["reply_lengths"]["not_exact"]:
        log(f"  reply not {REPLY} tokens: {x}")


def agent(a) -> None:
    from mbolt.bench import agent as ag

    dst = ROOT / "results" / f"serve_agent_{a.model}.json"
    run = start_run(a, workload_prereg(a, "serve_agent.toml"), ag.GOAL_KEYS, dst,
                    f"{a.rounds} round(s): warm once, then cold, cold (A/A), restored, restored (A/A), four clients "
                    f"{'in every round' if a.four_clients_rounds is None else f'in the first {a.four_clients_rounds}'} "
                    f"({ag.PREFIX}-token prefix, {ag.TURN}-token turn, {ag.REPLY}-token reply, readahead "
                    f"{a.readahead} KiB)")
    if run is None:
        return
    pr, rec, model, size, ram = run
    ids = session_text_ids(model, tokens=ag.PREFIX + 7 * ag.TURN)
    with readahead(model, a.readahead) as ra:
        out = ag.run(model, ids, a.rounds, ram, four_rounds=a.four_clients_rounds)
    out = {**result_head("an agent's prefix restored from the prompt cache under a real memory limit (issue 55)",
                         "scripts/bench_serve.py --workload agent", a, size, ram, ra),
           "text": "held-out text of prompts.jsonl", "prompt_cache_size": ag.CACHE_SIZE,
           "four_clients_rounds": min(a.four_clients_rounds or a.rounds, a.rounds),
           "sampling": "temperature 1, top_k 0, top_p 1, min_p 0, fixed seed, ignore_eos", **out}
    out["goals"] = ag.goals(out, pr)
    finish_run(pr, rec, dst, out)


def concurrency(a) -> None:
    from mbolt.bench import serve_concurrency as sc

    clients = sorted({int(x) for x in a.clients.split(",")})
    dst = ROOT / "results" / f"serve_concurrency_{a.model}.json"
    plan = sc.plan_runs(clients)
    run = start_run(a, workload_prereg(a, "serve_concurrency.toml"), sc.GOAL_KEYS, dst,
                    f"{len(plan)} runs: " + ", ".join(f"{arm} x{c}" for arm, c in plan)
                    + f" ({a.turns} turns, {a.reply} tokens per reply)")
    if run is None:
        return
    pr, rec, model, size, ram = run
    need = FIRST + APPEND * a.turns
    ids = session_text_ids(model, tokens=sc.WINDOW * (max(clients) - 1) + need)
    sc.client_ids(ids, max(clients), need)  # every client's text is there before the first run, not after
    runs = []
    with readahead(model, a.readahead) as ra:
        for arm, c in plan:
            log(f"{arm}: {c} client(s)")
            runs.append(sc.run_clients(sys.modules[__name__], model, arm, c, max(clients), ram, ids, a.turns, a.reply))
    out = {**result_head("mbolt serve: concurrent conversations under a real memory limit (issue 34)",
                         "scripts/bench_serve.py --workload concurrency", a, size, ram, ra),
           "clients": clients,
           "conversation": {"first_prompt": FIRST, "append_per_turn": APPEND, "reply": a.reply, "turns": a.turns,
                            "client_window_tokens": sc.WINDOW,
                            "sampling": "temperature 1, top_k 0, top_p 1, min_p 0, seed per client and turn"},
           **sc.summarize(runs, clients, pr, ram), "runs": runs}
    finish_run(pr, rec, dst, out)


if __name__ == "__main__":
    main()
