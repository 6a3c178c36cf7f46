"""Markdown tables from the results of scripts/bench_memlimit.py and scripts/bench_serve.py:
README's figures and docs/results.md's tables are this script's output, pasted.

    python scripts/report_memlimit.py [session|decode|drives|serve|concurrency|deep|all]

results/session_<model>.json (issue 26), results/memlimit_<model>.json (issue 28, steady decode),
results/drives_<model>.json (drive profiles), results/serve_<model>.json (issue 27),
results/deep_<model>.json (scripts/bench_deep.py: the full-depth model, issue 35).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mbolt.bench.paired import row

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
SLICE = {"q864": "864 KiB, Q4_0", "q72": "72 KiB, Q4_0", "q4km": "Q4_K_M-like", "q48": "48 layers, Q4_K_M-like"}


def fmt(x, spec=".2f", unit=""):
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def load(prefix: str) -> list[dict]:
    out = []
    for p in sorted(RESULTS.glob(f"{prefix}_*.json")):
        if ".run" in p.name:  # an earlier run kept beside its successor: listed under it (earlier())
            continue
        d = json.loads(p.read_text())
        if prefix == "serve" and p.name.startswith("serve_concurrency_"):  # its own table (concurrency())
            continue
        if prefix == "deep" and p.name.endswith(("_warm.json", "_tuned.json")):  # deep()'s notes, deep_tuned()
            continue
        if prefix != "memlimit" or "headline" in d:  # the steady-decode format (issue 28)
            out.append(d)
    return out


def model_name(d: dict) -> str:
    return f"{d['model']} ({SLICE.get(d['model'], '?')}, {d['file_bytes'] / 1e9:.1f} GB)"


def met(goals: list[dict]) -> str:
    def value(v):
        if isinstance(v, float):
            return fmt(v, ".3f")
        if isinstance(v, list):  # [measured, predicted]
            return " / ".join(fmt(x, ".3f") if isinstance(x, float) else str(x) for x in v)
        return v

    return "; ".join(f"{g['goal']}: {value(g['value'])} ({'met' if g['met'] else 'MISSED'})" for g in goals)


def earlier(d: dict) -> list[str]:
    """The runs a result replaced (a re-run after a miss is an addendum): each stays in the report."""
    add = (d.get("prereg") or {}).get("addendum")
    lines = [f"- {d['model']}: this run is an addendum to {add['to']} after a miss: {add['miss']}."] if add else []
    for e in d.get("earlier_runs", []):
        lines.append(f"- {d['model']}: earlier run `results/{e['file']}` (git {e.get('git') or 'n/a'}): goals: "
                     f"{met(e.get('goals') or [])}.")
    return lines


def run_line(d: dict) -> str:
    m = d.get("machine")
    if not m:
        return ""
    return (f"- {d['model']}: git {d.get('git')}; {m['cpu']}, {m['cores']} cores, {fmt(m['memory_bytes'] / 2**30, '.1f')} "
            f"GiB, kernel {m['kernel']}, {m['device']} (read_ahead_kb {m.get('read_ahead_kb')}); load "
            f"{d.get('loadavg_before')} before, {d.get('loadavg_after')} after.")


def paired(st: dict | None) -> str:
    if not st or st.get("median") is None:
        return "n/a"
    ci = st.get("ci95")
    return f"{st['median']:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f" ({len(st['rounds'])} rounds)")


def session_tuned(d: dict) -> tuple[str, list[str]]:
    """A session result with plain tuned (issue 33): per configuration, paired ratios."""
    t, tuned = d["ttft_s"], d["plain_tuned_readahead_kb"]
    dec = d["decode_tokens_per_s"]
    shipped = dec.get(str(d["as_shipped_readahead_kb"])) or dec.get(d["as_shipped_readahead_kb"])
    line = (f"| {model_name(d)} | **{fmt(t['mbolt'], '.1f')}** / {fmt(t.get('warm', t['warm_512']), '.1f')} "
            f"({fmt(d['ttft_over_warm'])}x warm) | TTFT {paired(d['ttft_over_plain_tuned'])} of "
            f"{d['best_plain_ttft_arm']} at {tuned['ttft']} KiB; decode **{paired(d['decode_over_plain_tuned'])}** "
            f"{d['best_plain_decode_arm']} at {tuned['decode']} KiB | decode mbolt {fmt(shipped['mbolt'])} tok/s; "
            f"over plain as shipped {paired(d['over_plain_as_shipped']['decode'])} | "
            f"{fmt(d['followup_over_bound'])}x bound | {100 * d['prompt_bw_share']:.0f}% | "
            f"{fmt(d['user_over_root'])} | {fmt(d['aa']['plain'], '.3f')}, {fmt(d['aa']['mbolt'], '.3f')} |")
    sweep = "; ".join(f"{ra} KiB " + ", ".join(f"{a} {fmt(v['decode_tokens_per_s'])} tok/s {fmt(v['ttft_s'], '.1f')} s"
                                                for a, v in arms.items()) for ra, arms in d["sweep"]["plain"].items())
    notes = [f"- {d['model']}: plain's readahead sweep: {sweep}."]
    for ra, b in ((d.get("peers_ttft") or {}).get("beside") or {}).items():
        notes.append(f"- {d['model']} at {ra} KiB: ik_llama.cpp's best TTFT {fmt(b['best_peer_ttft_s'], '.1f')} s "
                     f"({b['best_peer_arm']}; warm {fmt(b['ik_warm_ttft_s'], '.1f')} s, {fmt(b['best_peer_over_its_warm'])}x "
                     f"its warm); mbolt {fmt(b['mbolt_ttft_s'], '.1f')} s, {fmt(b['mbolt_over_best_peer'])}x the peer's "
                     f"time ({fmt(b['mbolt_over_llama_cpp_warm'])}x llama.cpp warm).")
    return line, notes


def session() -> str:
    out = ["| model | TTFT, 2,000 tokens: mbolt / warm / plain-512 / plain-2048 (s) | decode after it: mbolt / "
           "plain-512 / plain-2048 (tok/s) | follow-up TTFT: mbolt / warm / bound (s) | prompt read MB/s "
           "(sequential) | ordinary user / root | A/A plain, mbolt |", "|---|---|---|---|---|---|---|"]
    notes = []
    tuned_rows = []
    for d in load("session"):
        if "configs" in d:
            line, more = session_tuned(d)
            tuned_rows.append(line)
            notes += more + [f"- {d['model']} goals: {met(d['goals'])}."] + earlier(d) + [run_line(d)]
            continue
        t, dec, f = d["ttft_s"], d["decode_tokens_per_s"], d["followup_ttft_s"]
        out.append(
            f"| {model_name(d)} | **{fmt(t['mbolt'], '.1f')}** / {fmt(t['warm_512'], '.1f')} / "
            f"{fmt(t['plain_512'], '.1f')} / {fmt(t['plain_2048'], '.1f')} ({fmt(d['ttft_over_warm'])}x warm) | "
            f"**{fmt(dec['mbolt'])}** / {fmt(dec['plain-512'])} / {fmt(dec['plain-2048'])} "
            f"({fmt(d['decode_over_best_plain'])}x the better plain) | {fmt(f['mbolt'])} / {fmt(f['warm_512'])} / "
            f"{fmt(d['followup_bound_s'])} ({fmt(d['followup_over_bound'])}x) | "
            f"{fmt(d['prompt_read_mb_per_s'], '.0f')} ({d['drive']['sequential_bytes_per_s'] / 1e6:.0f}: "
            f"{100 * d['prompt_bw_share']:.0f}%) | {fmt(d['user_over_root'])} | "
            f"{fmt(d['aa']['plain'], '.3f')}, {fmt(d['aa']['mbolt'], '.3f')} |")
        lim = d["limited"]
        for other, shipped in (("mbolt-2048", 512), ("mbolt-512", 2048)):  # the default changed on 2026-12-05
            row = next((r for r in lim["summary"] if r["arm"] == other), None)
            if row:
                notes.append(f"- {d['model']}: the runtime asked for {other[6:]}-token passes: TTFT "
                             f"{fmt(row['ttft_s'], '.1f')} s, decode {fmt(d['decode_tokens_per_s'].get(other))} tok/s "
                             f"({shipped}: {fmt(t['mbolt'], '.1f')} s, {fmt(dec['mbolt'])} tok/s).")
        notes.append(f"- {d['model']} goals: {met(d['goals'])}.")
        notes += earlier(d)
    if tuned_rows:
        out = (out if len(out) > 2 else []) + [
            "", "| model | TTFT mbolt / warm (s) | over plain tuned (same-round ratio) | as shipped (128 KiB) | "
            "follow-up | prompt read share | ordinary user / root | A/A plain, mbolt |",
            "|---|---|---|---|---|---|---|---|"] + tuned_rows
    return "\n".join(out + [""] + [n for n in notes if n])


def decode() -> str:
    out = ["| model | plain as shipped (128 KiB) | plain tuned (readahead) | mbolt runtime | over plain tuned | "
           "A/A plain, mbolt | bound (limit) | share of bound |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for d in load("memlimit"):
        tuned = d["plain_tuned_readahead_kb"]
        shipped = d["decode_tokens_per_s"].get("128") or d["decode_tokens_per_s"].get(128)
        best = d["decode_tokens_per_s"].get(str(tuned)) or d["decode_tokens_per_s"].get(tuned)
        aa = d["aa"].get(str(tuned)) or d["aa"].get(tuned)
        b = d.get("bound") or {}
        out.append(f"| {model_name(d)} | {fmt(shipped['plain-stock'])} | {fmt(best['plain-stock'])} ({tuned} KiB) | "
                   f"**{fmt(best['mbolt-stock'])}** | **{fmt(d['headline'])}x** | {fmt(aa['plain'], '.3f')}, "
                   f"{fmt(aa['mbolt'], '.3f')} | {fmt(b.get('tokens_per_s'))} tok/s ({b.get('limit', 'n/a')}) | "
                   f"{fmt(d.get('share_of_bound'))} |")
        ro = d["reorder_over_stock"].get("128") or d["reorder_over_stock"].get(128)
        sw = d["sweep"]
        per = (sw["plain_tokens_per_s"] if "plain_tokens_per_s" in sw
               else {ra: v["plain-stock"]["decode_tokens_per_s"] for ra, v in sw["plain"].items()})
        sweep = ", ".join(f"{ra} KiB {fmt(v)}" for ra, v in sorted(per.items(), key=lambda kv: -int(kv[0])))
        notes.append(f"- {d['model']}: plain's readahead sweep ({d['sweep']['tokens']} tokens, {d['sweep']['rounds']} "
                     f"rounds): {sweep} tok/s; the reorder file over stock at 128 KiB: plain {fmt(ro['plain'])}x, "
                     f"mbolt {fmt(ro['mbolt'])}x; warm {fmt(d['warm_tokens_per_s'])} tok/s; goals: {met(d['goals'])}.")
        for ra, pe in (d.get("peers") or {}).items():
            notes.append(f"- {d['model']}: the peer at {ra} KiB: best arm {pe['best_peer_arm']} "
                         f"{fmt(pe['best_peer_tokens_per_s'])} tok/s, mbolt-stock over it "
                         f"**{fmt(pe['mbolt_over_best_peer'])}x**; warm ik_llama.cpp {fmt(pe['ik_warm_tokens_per_s'])}, "
                         f"llama.cpp {fmt(pe['llama_cpp_warm_tokens_per_s'])} tok/s (fed: {pe['fed']}).")
        notes += earlier(d) + [run_line(d)]
    return "\n".join(out + [""] + [n for n in notes if n])


def drives() -> str:
    out = ["| model | drive | plain stock / reorder (tok/s) | mbolt stock / reorder (tok/s) | mbolt over plain | "
           "MB read per token: plain / mbolt (MIN) | layout gain plain: measured / law | "
           "layout gain mbolt: measured / law | bound (share) |",
           "|---|---|---|---|---|---|---|---|---|"]
    out_goals = []
    for d in load("drives"):
        for prof, pp in d["profiles"].items():
            # issue 33's results: one configuration per readahead (128 KiB as shipped, plain tuned)
            cs = pp["configs"].items() if "configs" in pp else [(str(d.get("readahead_kb", 128)), pp)]
            for ra, p in cs:
                out.append(drive_row(d, f"{prof} at {ra} KiB", p))
        out_goals += [f"- {d['model']}: goals: {met(d['goals'])}."] + earlier(d) + [run_line(d)]
    return "\n".join(out + [""] + [g for g in out_goals if g])


def drive_row(d: dict, where: str, p: dict) -> str:
    rows = {r["arm"]: r.get("decode_tokens_per_s") for r in p["ab"]["summary"]}
    lw = p["law"]
    over = p["over_plain"]["median"] if isinstance(p["over_plain"], dict) else p["over_plain"]

    def mb(kind: str):  # the stock arm's decode bytes per token as the drive served them
        st = (lw[kind].get("served_per_token") or {}).get("stock")
        return st[1] / 1e6 if st else None

    min_mb = (p.get("bound") or {}).get("min_miss_bytes_per_token")
    return (f"| {d['model']} | {where} | {fmt(rows.get('plain-stock'))} / {fmt(rows.get('plain-reorder'))} | "
            f"{fmt(rows.get('mbolt-stock'))} / {fmt(rows.get('mbolt-reorder'))} | "
            f"**{fmt(over)}x** | {fmt(mb('plain'), '.1f')} / {fmt(mb('mbolt'), '.1f')} "
            f"({fmt(min_mb and min_mb / 1e6, '.1f')}) | {fmt(p['layout_gain']['plain'])} / "
            f"{fmt(lw['plain']['predicted_gain'])} | {fmt(p['layout_gain']['mbolt'])} / "
            f"{fmt(lw['mbolt']['predicted_gain'])} | "
            + (f"{fmt(p['bound']['tokens_per_s'])} tok/s ({100 * p['share_of_bound']:.0f}%) |"
               if p.get("bound") else "- |"))


def serve() -> str:
    out = []
    for d in load("serve"):
        out += [f"{model_name(d)}, budget {100 * d['budget_frac']:.0f}% ({d['budget_bytes'] / 2**30:.2f} GiB), "
                f"readahead {d['readahead_kb']} KiB, {len(d['rounds'])} round(s):", "",
                "| turn | prompt tokens | TTFT mbolt / plain / warm (s) | decode mbolt / plain / warm (tok/s) | "
                "decode over plain |", "|---|---|---|---|---|"]
        for r, t in zip(d["per_turn"], d["rounds"][0]["arms"]["mbolt"]["turns"]):
            out.append(f"| {r['turn']} | {t['prompt_tokens']} | {fmt(r['mbolt_ttft_s'])} / {fmt(r['plain_ttft_s'])} / "
                       f"{fmt(r['warm_ttft_s'])} | {fmt(r['mbolt_decode_tokens_per_s'])} / "
                       f"{fmt(r['plain_decode_tokens_per_s'])} / {fmt(r['warm_decode_tokens_per_s'])} | "
                       f"**{fmt(r['decode_over_plain'])}x** |")
        out += ["", f"Goals: {met(d['goals'])}."]
    return "\n".join(out)


def concurrency() -> str:
    out = []
    for d in load("serve_concurrency"):
        cs = [str(c) for c in d["clients"]]
        t = d["decode_tokens_per_s_total"]
        out += [f"{model_name(d)}, budget {100 * d['budget_frac']:.0f}% ({d['budget_bytes'] / 2**30:.2f} GiB), "
                f"readahead {d['readahead_kb']} KiB; {d['conversation']['turns']} turns of "
                f"{d['conversation']['reply']} tokens per client:", "",
                "| clients | mbolt (tok/s, all clients) | plain | mbolt -np 1 | mbolt over plain | mbolt over -np 1 | "
                "mbolt over one client |", "|---|---|---|---|---|---|---|"]
        for c in cs:
            out.append(f"| {c} | **{fmt(t['mbolt'][c])}** | {fmt(t['plain'][c])} | {fmt(t['mbolt-np1'].get(c))} | "
                       f"**{fmt(d['mbolt_over_plain'][c], unit='x')}** | {fmt(d['mbolt_over_np1'].get(c), unit='x')} | "
                       f"{fmt(d['scaling_over_one_client'][c], unit='x')} |")
        out += ["", f"A newcomer's time to first token: {fmt(d['newcomer_ttft_s'])} s beside "
                f"{max(d['clients']) - 1} decoding clients, {fmt(d['alone_ttft_s'])} s alone. Goals: {met(d['goals'])}."]
    return "\n".join(out)


def deep() -> str:
    out = ["| model | warm: plain / mbolt (tok/s) | mbolt over plain warm | beyond plain per MoE layer | "
           "limited: plain / mbolt (tok/s) | mbolt over plain | reads then compute (share) | bound (share) | "
           "A/A plain-warm, mbolt-warm, plain, mbolt |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for d in load("deep"):
        w, lim = d["decode_tokens_per_s"]["warm"], d["decode_tokens_per_s"]["limited"]
        rtc, b, aa = d.get("reads_then_compute") or {}, d.get("bound") or {}, d["aa"]
        out.append(f"| {model_name(d)} | {fmt(w['plain-warm'])} / {fmt(w['mbolt-warm'])} | "
                   f"**{paired(d['warm_over_plain_warm'])}** | {fmt(d['warm_beyond_plain_us_per_moe_layer'], '.0f')} us | "
                   f"{fmt(lim['plain-stock'])} / **{fmt(lim['mbolt-stock'])}** | **{paired(d['over_plain'])}** | "
                   f"{fmt(rtc.get('tokens_per_s'))} tok/s ({fmt(rtc.get('share'))}) | "
                   f"{fmt(b.get('tokens_per_s'))} tok/s, {b.get('limit', 'n/a')} ({fmt(d.get('share_of_bound'))}) | "
                   + ", ".join(fmt(aa[k], ".3f") for k in ("plain-warm", "mbolt-warm", "plain-stock", "mbolt-stock"))
                   + " |")
        notes += [f"- {d['model']}: budget {d['budget_bytes'] / 2**30:.2f} GiB ({100 * d['budget_frac']:.0f}%), warm "
                  f"inside {d['warm_limit_bytes'] / 2**30:.1f} GiB, readahead {d['readahead_kb']} KiB; "
                  f"{d['workload']['prompt']}-token prompt, {d['workload']['new']} fed tokens, {d['rounds']} rounds; "
                  f"not run: {'; '.join(d['not_run'])}.", f"- {d['model']} goals: {met(d['goals'])}."]
        pe = d.get("peers")
        if pe:
            ik = {s["arm"]: s["decode_tokens_per_s"] for s in d["peer_limited"]["summary"]}
            notes.append(f"- {d['model']}: the peer under the same limit: "
                         + ", ".join(f"{a} {fmt(v)}" for a, v in ik.items()) + " tok/s; best arm "
                         f"{pe['best_peer_arm']}, mbolt-stock over it **{fmt(pe['mbolt_over_best_peer'])}x**; warm "
                         f"ik_llama.cpp {fmt(pe['ik_warm_tokens_per_s'])}, llama.cpp {fmt(pe['llama_cpp_warm_tokens_per_s'])}"
                         f" tok/s (ik's kernels {fmt(pe['ik_kernels_over_llama_cpp_warm'])}x; fed: {pe['fed']}).")
        notes += earlier(d) + [run_line(d)]
    for p in sorted(RESULTS.glob("deep_*_warm.json")):
        d = json.loads(p.read_text())
        t, aa = d["decode_tokens_per_s"], d["aa"]
        notes += [f"- {d['model']}, the warm stage alone (`{p.name}`, {d['rounds']} rounds): plain warm "
                  f"{fmt(t['plain-warm'])}, mbolt warm {fmt(t['mbolt-warm'])} tok/s, **{paired(d['warm_over_plain_warm'])}**"
                  f", {fmt(d['warm_beyond_plain_us_per_moe_layer'], '.0f')} us per MoE layer beyond plain; A/A "
                  f"{fmt(aa['plain-warm'], '.3f')}, {fmt(aa['mbolt-warm'], '.3f')}; goals: {met(d['goals'])}.",
                  run_line(d)]
    return "\n".join(out + [""] + [n for n in notes if n] + ["", deep_tuned()])


def deep_tuned() -> str:
    """bench_deep.py's tuned stage, with the warm stage's compute beside it (its own run: the bound
    is the compute when the runtime's own bytes at the drive's rate take less time, and MIN reads
    no more than the runtime)."""
    out = ["| model | plain's sweep (decode tok/s by readahead) | plain tuned | mbolt | over plain tuned | best peer | "
           "over best peer | warm compute (its run) | reads then compute (share) | bound (share) | A/A plain, mbolt, ik |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for p in sorted(RESULTS.glob("deep_*_tuned.json")):
        d = json.loads(p.read_text())
        t, aa, pe, ra = d["decode_tokens_per_s"], d["aa"], d.get("peers") or {}, d["plain_tuned_readahead_kb"]
        sweep = ", ".join(f"{k}: {fmt(v['plain-stock']['decode_tokens_per_s'])}" for k, v in d["sweep"]["plain"].items())
        warm_p = RESULTS / p.name.replace("_tuned.json", "_warm.json")
        warm = json.loads(warm_p.read_text()) if warm_p.exists() else None
        compute = warm and warm["decode_tokens_per_s"]["plain-warm"]
        m = row(d["limited"], "mbolt-stock")
        bw = d["drive"]["sequential_bytes_per_s"]
        own = bw / m["device_bytes_per_token"] if m.get("device_bytes_per_token") else None
        rtc = 1 / (1 / own + 1 / compute) if own and compute else None
        bound = compute if compute and own and own >= compute else None
        ik_aa = (d.get("peer_limited") or {}).get("aa", {}).get("ik-mapped (A/A)")
        out.append(f"| {model_name(d)} | {sweep} | {fmt(t['plain-stock'])} ({ra} KiB) | **{fmt(t['mbolt-stock'])}** | "
                   f"**{paired(d['over_plain_tuned'])}** | {fmt(pe.get('best_peer_tokens_per_s'))} "
                   f"({pe.get('best_peer_arm', 'n/a')}) | **{fmt(pe.get('mbolt_over_best_peer'))}x** | {fmt(compute)} tok/s | "
                   f"{fmt(rtc)} tok/s ({fmt(rtc and t['mbolt-stock'] / rtc)}) | "
                   f"{fmt(bound)} tok/s, compute ({fmt(bound and t['mbolt-stock'] / bound)}) | "
                   f"{fmt(aa['plain-stock'], '.3f')}, {fmt(aa['mbolt-stock'], '.3f')}, {fmt(ik_aa, '.3f')} |")
        notes += [f"- {d['model']} (`{p.name}`): budget {d['budget_bytes'] / 2**30:.2f} GiB, {d['workload']['prompt']}-token "
                  f"prompt, {d['workload']['new']} fed tokens, {d['rounds']} rounds; the sweep {d['sweep']['rounds']} rounds "
                  f"of {d['sweep']['tokens']} tokens; the drive {bw / 1e6:.0f} MB/s sequential (the better of two probes); "
                  f"mbolt {m['device_bytes_per_token'] / 1e6:.0f} MB a token from the drive, TTFT {fmt(m.get('ttft_s'), '.1f')} s "
                  f"(plain {fmt(row(d['limited'], 'plain-stock').get('ttft_s'), '.1f')} s); "
                  f"not run: {'; '.join(d['not_run'])}.", f"- {d['model']} goals: {met(d['goals'])}.", run_line(d)]
        if warm:
            notes.append(f"- the warm compute: `{warm_p.name}`, " + run_line(warm).lstrip("- "))
    return "\n".join(out + [""] + notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["session", "decode", "drives", "serve", "concurrency", "deep", "all"])
    a = ap.parse_args()
    parts = {"session": session, "decode": decode, "drives": drives, "serve": serve, "concurrency": concurrency,
             "deep": deep}
    for name, fn in parts.items():
        if a.what in (name, "all"):
            sys.stdout.write(f"\n### {name}\n\n{fn()}\n")


if __name__ == "__main__":
    main()
