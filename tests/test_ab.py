"""`mbolt ab` on tiny files: rounds, A/A control, refusals, flags, pre-registration."""

import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from mbolt.bench.ab import run_ab

from mbolt.bench.arms import Arm, parse_arm, RoundResult

from mbolt.bench.design import arm_orders, williams_rows

from mbolt.bench.stats import median_ci, stop_check, StopRule, summarise
from mbolt.bench.prereg import check_and_lock, load_prereg, verdict
from mbolt.cli import app
from mbolt.core.errors import MboltError, MboltWarning
from mbolt.synth.synth import SynthConfig, write_synth
from mbolt.rewrite.reorder import reorder
from mbolt.core.mbtrace import write_trace
from mbolt.core.trace import DECODE, Trace

L, E, K = 2, 8, 2


def rand_trace(n=12, seed=0, fingerprint="", n_choices=E):
    rng = np.random.default_rng(seed)
    ex = np.stack([np.stack([rng.choice(n_choices, K, replace=False) for _ in range(L)]) for _ in range(n)]).astype(np.int16)
    return Trace(L, E, K, ex, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                 fingerprint=fingerprint)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ab")
    stock = d / "stock.gguf"
    write_synth(stock, SynthConfig(n_layers=L, n_experts=E, n_used=K, hidden=64, expert_ff=32))
    perm = np.stack([np.random.default_rng(l).permutation(E) for l in range(L)]).astype(np.int32)
    packed = d / "packed.gguf"
    reorder(stock, packed, perm, layout="packed", method="test", sidecar=False)
    other = d / "other.gguf"
    write_synth(other, SynthConfig(n_layers=L, n_experts=E, n_used=K, hidden=64, expert_ff=32, seed=7))
    tr = d / "held.mbtrace"
    write_trace(tr, rand_trace())
    return {"stock": stock, "packed": packed, "other": other, "trace": tr, "dir": d}


def test_replay_rounds_follow_the_design_and_aa(files):
    res = run_ab([Arm("stock", str(files["stock"])), Arm("packed", str(files["packed"]))], trace=rand_trace(),
                 rounds=6, seed=5, host_cache={})
    names = [a["name"] for a in res.arms]
    assert names == ["stock", "packed", "stock (A/A)"]
    # every round ran in the recorded order, which is the seeded design's
    ran = [[r.arm for r in sorted((r for r in res.rounds if r.round == k), key=lambda r: r.position)]
           for k in range(6)]
    assert ran == res.design["orders"] == [[names[i] for i in o] for o in arm_orders(3, 6, seed=5)]
    seq = [r.arm for r in res.rounds]
    assert all(a != b for a, b in zip(seq, seq[1:]))  # never twice in a row, across rounds too
    assert [r.prev_arm for r in res.rounds] == [None] + seq[:-1]
    for name in names:  # one block of 6 rounds: every arm twice in every position
        assert sorted(r.position for r in res.rounds if r.arm == name) == [0, 0, 1, 1, 2, 2]
    assert res.stop["reason"] == "fixed rounds" and res.stop["rounds"] == 6
    assert res.cold and all(r.resident_after <= 0.01 for r in res.rounds)
    s = {x["arm"]: x for x in res.summary}
    # 12 tokens x 2 layers x 2 experts x 3 tensors: stock reads every slice alone unless adjacent
    assert s["stock"]["reads_per_token"] > s["packed"]["reads_per_token"]
    assert s["stock"]["reads_per_token"] == s["stock (A/A)"]["reads_per_token"]
    assert len(s["packed"]["per_round_speedup"]) == 6
    assert s["packed"]["speedup_ci95"] is None and "no interval: 6 rounds" in s["packed"]["ci_note"]
    assert any("no confidence intervals" in n for n in res.notes)
    assert {"ratio_of_medians", "median_of_ratios"} <= set(s["packed"])
    assert not [f for f in res.flags if "identical" in f]


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7])
def test_arm_orders_balance_positions_and_neighbours(n):
    from collections import Counter

    block = len(williams_rows(n))
    orders = arm_orders(n, 3 * block, seed=11)
    seq = [x for o in orders for x in o]
    assert all(a != b for a, b in zip(seq, seq[1:])), "an arm ran twice in a row"
    for b in range(3):
        rows = orders[b * block:(b + 1) * block]
        assert all(sorted(r) == list(range(n)) for r in rows)
        pos = Counter((x, i) for r in rows for i, x in enumerate(r))
        assert set(pos.values()) == {block // n} and len(pos) == n * n  # every arm equally often in every place
        pairs = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1  # every neighbour pair equally often
    assert arm_orders(n, 2 * block, seed=11) == orders[:2 * block]  # seeded and prefix-stable
    assert arm_orders(n, 3 * block, seed=12) != orders


def test_arm_orders_two_arms_alternate():
    seq = [x for o in arm_orders(2, 9, seed=1) for x in o]
    assert all(a != b for a, b in zip(seq, seq[1:]))


def test_median_ci_rules():
    assert median_ci(np.arange(9.0)) is None  # fewer than 10 rounds: no interval
    x = np.array([3.0, 9, 1, 7, 5, 2, 10, 4, 8, 6])
    # n = 10: P(B <= 1) = 11/1024 <= 2.5% < P(B <= 2) = 56/1024 -> ranks 2 and 9 (textbook)
    assert median_ci(x) == (2.0, 9.0)
    # coverage on a known distribution (lognormal, true median 1): exact level for n=15 is
    # 1 - 2 P(B <= 3) = 96.5%
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(4000):
        lo, hi = median_ci(rng.lognormal(0.0, 0.3, 15))
        hits += lo <= 1.0 <= hi
    assert 0.95 <= hits / 4000 <= 0.98


def fake_round(arm, rnd, pos, io_s, prev, tokens=10):
    return RoundResult(arm, rnd, pos, 0.0, 0.0, True, False, tokens, io_s * 1.1, io_s, 0.0, 100, 1000, 1000,
                       None, 0, 0, 0, prev_arm=prev)


def test_ratio_of_medians_and_median_of_ratios():
    base = [10, 10, 10, 10, 10, 30, 30, 30, 30, 30]
    arm = [5, 5, 5, 5, 5, 30, 30, 30, 30, 30]
    rounds = [fake_round("stock", k, 0, base[k], None) for k in range(10)] + \
             [fake_round("packed", k, 1, arm[k], "stock") for k in range(10)]
    arms = [Arm("stock", "s.gguf"), Arm("packed", "p.gguf")]
    s = {x["arm"]: x for x in summarise(arms, rounds, "io_s")}
    # per-round ratios 2,2,2,2,2,1,1,1,1,1 -> median 1.5; medians 20 / 17.5
    assert s["packed"]["median_of_ratios"] == pytest.approx(1.5)
    assert s["packed"]["speedup_vs_baseline_median"] == pytest.approx(1.5)
    assert s["packed"]["ratio_of_medians"] == pytest.approx(20 / 17.5)
    assert s["packed"]["speedup_ci95"] == [1.0, 2.0]
    from mbolt.report.bench_tables import ab_table

    d = {"name": "t", "metric": "io_s", "cold": True, "mode": "replay", "baseline": "stock", "summary": list(s.values()),
         "rounds": [r.__dict__ for r in rounds]}
    out = render(ab_table(d))
    assert "speedup = median over rounds of (stock io/token / the arm's)" in " ".join(out.split())
    row = next(line for line in out.splitlines() if line.strip().startswith("packed"))
    assert " 1.50 " in row and "1.14" not in row


def render(table) -> str:
    from rich.console import Console

    c = Console(width=200, record=True)
    c.print(table)
    return c.export_text()


def fake_runner(times):
    """A "run this arm once" function without I/O: time per token from times(arm, job)."""
    def run(arm, mm, job):
        return fake_round(arm.name, job.rnd, job.position, times(arm.name, job), job.prev_arm)
    return run


@pytest.fixture
def fake_mode(monkeypatch):
    import mbolt.bench.runners as runners

    def install(times):
        monkeypatch.setitem(runners.ARM_RUNNERS, "fake", fake_runner(times))
        monkeypatch.setitem(runners.MODE_METRIC, "fake", "io_s")
    return install


def test_adaptive_stop(files, fake_mode):
    rng = np.random.default_rng(0)
    arms = lambda: [Arm("stock", str(files["stock"])), Arm("packed", str(files["packed"]))]  # noqa: E731
    # quiet machine: A/A within 1%, treated arm 2x: converges at the first check from min_rounds
    fake_mode(lambda name, job: (5.0 if name == "packed" else 10.0) * rng.normal(1.0, 0.005))
    res = run_ab(arms(), mode="fake", stop=StopRule(min_rounds=12, max_rounds=60), host_cache={})
    assert res.stop["reason"] == "converged" and res.stop["rounds"] == 12  # 12 = two blocks of 6
    assert "A/A interval" in res.stop["detail"]
    # a biased A/A (+10%): never converges, stops at max_rounds
    fake_mode(lambda name, job: 11.0 if name.endswith("(A/A)") else 10.0 * rng.normal(1.0, 0.005))
    res = run_ab(arms(), mode="fake", stop=StopRule(min_rounds=12, max_rounds=24), host_cache={})
    assert (res.stop["reason"], res.stop["rounds"]) == ("max rounds", 24)
    assert any(re.search(r"A/A control off by -9\.\d%", f) for f in res.flags), res.flags
    # a spent time budget stops after the round it was spent in
    res = run_ab(arms(), mode="fake", stop=StopRule(time_budget_s=0.0, budget_at_checks=False), host_cache={})
    assert (res.stop["reason"], res.stop["rounds"]) == ("time budget", 1)
    # by default only at the end of a balanced block (6 rounds here), from min_rounds on
    res = run_ab(arms(), mode="fake", stop=StopRule(time_budget_s=0.0, min_rounds=1), host_cache={})
    assert (res.stop["reason"], res.stop["rounds"]) == ("time budget", 6)


def test_stop_check_rules():
    rule = StopRule(min_rounds=12, max_rounds=100, time_budget_s=60.0, precision=0.05, budget_at_checks=False)
    ok = [{"arm": "stock", "median_of_ratios": 1.0, "speedup_ci95": [1.0, 1.0]},
          {"arm": "packed", "median_of_ratios": 2.0, "speedup_ci95": [1.95, 2.05]},
          {"arm": "stock (A/A)", "median_of_ratios": 1.0, "speedup_ci95": [0.98, 1.02]}]
    assert stop_check(ok, "stock", 6, 1.0, rule, block=6) is None  # before min_rounds
    assert stop_check(ok, "stock", 13, 1.0, rule, block=6) is None  # not at a block end
    assert stop_check(ok, "stock", 12, 1.0, rule, block=6)[0] == "converged"
    wide_aa = [dict(x) for x in ok]
    wide_aa[2]["speedup_ci95"] = [0.96, 1.02]
    assert stop_check(wide_aa, "stock", 12, 1.0, rule, block=6) is None
    wide = [dict(x) for x in ok]
    wide[1]["speedup_ci95"] = [1.7, 2.1]  # half-width 10% of 2.0
    assert stop_check(wide, "stock", 12, 1.0, rule, block=6) is None
    assert stop_check(wide, "stock", 13, 61.0, rule, block=6)[0] == "time budget"
    assert stop_check(wide, "stock", 102, 1.0, rule, block=6)[0] == "max rounds"
    # budget at checks only: at a check, stop when one more interval would overrun the budget
    r2 = StopRule(min_rounds=12, time_budget_s=60.0, check_every=12, budget_at_checks=True)
    assert stop_check(wide, "stock", 13, 70.0, r2, block=6) is None
    assert stop_check(wide, "stock", 12, 25.0, r2, block=6) is None  # 25 + 25 <= 60
    assert stop_check(wide, "stock", 12, 31.0, r2, block=6)[0] == "time budget"
    assert stop_check(ok, "stock", 3, 1.0, StopRule(rounds=3), block=6)[0] == "fixed rounds"


def test_order_effects_find_a_carryover(files, fake_mode):
    # following "packed" costs +10%, position 2 costs +4%: both recovered from the balanced design
    # (deviation coding: packed is 2/3 log(1.10) above the mean over predecessors = +6.6%)
    def times(name, job):
        t = {"stock": 10.0, "packed": 5.0, "stock (A/A)": 10.0}[name] * (1 + 0.01 * (job.rnd % 3))
        return t * (1.10 if job.prev_arm == "packed" else 1.0) * (1.04 if job.position == 2 else 1.0)
    fake_mode(times)
    res = run_ab([Arm("stock", str(files["stock"])), Arm("packed", str(files["packed"]))], mode="fake", rounds=18,
                 host_cache={})
    e = res.effects
    assert e["estimable"]
    c, p = e["carryover_pct"], e["position_pct"]
    assert (1 + c["packed"] / 100) / (1 + c["stock"] / 100) == pytest.approx(1.10, rel=1e-6)
    assert (1 + c["stock (A/A)"] / 100) / (1 + c["stock"] / 100) == pytest.approx(1.0, abs=1e-6)
    assert (1 + p["2"] / 100) / (1 + p["0"] / 100) == pytest.approx(1.04, rel=1e-6)
    assert e["residual_sd_pct"] < 1e-6
    assert any("carryover packed: +6.6%" in n for n in res.notes), res.notes
    # the balanced design cancels both in the A/A ratio
    aa = next(x for x in res.summary if x["arm"] == "stock (A/A)")
    assert aa["median_of_ratios"] == pytest.approx(1.0, abs=0.05)


def test_refuses_other_model_and_other_trace(files):
    with pytest.raises(MboltError, match="not the same model"):
        run_ab([Arm("a", str(files["stock"])), Arm("b", str(files["other"]))], trace=rand_trace(), rounds=1)
    # same geometry, another fingerprint: one warning (another quantisation of the same model)
    with pytest.warns(MboltWarning, match="trace: trace was recorded on a model with fingerprint ffffffffffff"):
        run_ab([Arm("a", str(files["stock"]))], trace=rand_trace(fingerprint="f" * 64), rounds=1)
    bad = rand_trace()
    bad.n_experts = 16
    with pytest.raises(MboltError, match="trace: trace is for .* x 16 experts"):
        run_ab([Arm("a", str(files["stock"]))], trace=bad, rounds=1)


def test_flags_identical_counters(files):
    # two arms that differ only in merge gap on a packed file whose padding is always read
    # through: they read the same -> flagged as "should differ"
    res = run_ab([Arm("p", str(files["packed"])), Arm("p-gap", str(files["packed"]), gap=1)], trace=rand_trace(),
                 rounds=1, aa=False)
    assert any("identical counters" in f for f in res.flags)


def test_parse_arm():
    a = parse_arm("x.gguf:name=fast,qd=4,direct,gap=4096,cache=3", 0)
    assert (a.name, a.io_threads, a.direct, a.gap, a.cache_slots, a.mode) == ("fast", 4, True, 4096, 3, "read")
    assert parse_arm("x.gguf:os", 1).mode == "os"
    assert parse_arm("x.gguf:frac=0.25", 1).resident_frac == 0.25
    with pytest.raises(MboltError):
        parse_arm("x.gguf:bogus=1", 0)


def test_cli_writes_json_with_aa(files, tmp_path):
    r = CliRunner().invoke(app, ["ab", str(files["stock"]), f"{files['packed']}:name=packed,qd=2",
                                 "--replay", str(files["trace"]), "--rounds", "2", "--name", "tiny",
                                 "--out-dir", str(tmp_path), "--probe", str(fake_probe(tmp_path)),
                                 "--plot", str(tmp_path / "tiny.png")])
    assert r.exit_code == 0, r.output
    assert "prediction" in r.output
    assert (tmp_path / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads((tmp_path / "tiny.json").read_text())
    assert [p["arm"] for p in d["prediction"]] == ["stock", "packed", "stock (A/A)"]
    assert [a["name"] for a in d["arms"]][-1].endswith("(A/A)")
    assert {"kernel", "filesystem", "device", "memory", "git"} <= set(d["environment"])
    assert all("description" in a["read_pattern"] for a in d["arms"])
    assert len(d["rounds"]) == 2 * 3
    r = CliRunner().invoke(app, ["ab", str(files["stock"]), str(files["other"]), "--replay", str(files["trace"]),
                                 "--out-dir", str(tmp_path)])
    assert r.exit_code == 2 and "not the same model" in r.output


def test_prereg_lock_and_verdict(files, tmp_path, monkeypatch):
    monkeypatch.setenv("TINY", str(files["dir"]))
    p = tmp_path / "tiny.toml"
    p.write_text(
        'name = "tiny_prereg"\nmode = "replay"\ntrace = "${TINY}/held.mbtrace"\nrounds = 2\nmetric = "io_s"\n'
        'baseline = "stock"\ntreatment = "packed"\npredicted_speedup = 1.2\npass_threshold = 0.0001\n'
        '[[arm]]\nname = "stock"\nfile = "${TINY}/stock.gguf"\n'
        '[[arm]]\nname = "packed"\nfile = "${TINY}/packed.gguf"\n')
    r = CliRunner().invoke(app, ["ab", "--prereg", str(p), "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "tiny_prereg.json").read_text())
    assert d["prereg"]["sha256"] == json.loads((tmp_path / "tiny.toml.lock").read_text())["sha256"]
    v = d["prereg"]["result"]
    assert v["by_threshold"] == "PASS"
    assert v["verdict"] == ("PASS" if v["aa_within_tolerance"] else "INCONCLUSIVE")
    assert v["verdict"] in r.output
    # edited after its first run: refused
    p.write_text(p.read_text().replace("1.2", "1.5"))
    r = CliRunner().invoke(app, ["ab", "--prereg", str(p), "--out-dir", str(tmp_path), "--force"])
    assert r.exit_code == 2 and "edited after its first run" in r.output
    pr = load_prereg(p)
    with pytest.raises(MboltError):
        check_and_lock(pr)
    fail = verdict(pr, [{"arm": "packed", "speedup_vs_baseline_median": 0.00005, "speedup_ci95": [0.00004, 0.00006]}])
    assert fail["verdict"] == "FAIL"
    rows = [{"arm": "packed", "speedup_vs_baseline_median": 2.0, "speedup_ci95": [1.9, 2.1]},
            {"arm": "stock (A/A)", "speedup_vs_baseline_median": 1.05, "speedup_ci95": [1.0, 1.1]}]
    v = verdict(pr, rows)  # the A/A control is 5% off: no verdict either way
    assert (v["verdict"], v["by_threshold"]) == ("INCONCLUSIVE", "PASS")
    rows[1]["speedup_vs_baseline_median"] = 1.02
    assert verdict(pr, rows)["verdict"] == "PASS"


def test_decode_mode_runs(files):
    res = run_ab([Arm("stock", str(files["stock"]))], mode="decode", prompts=[[1, 2, 3]], n_new=2, rounds=1)
    s = res.summary[0]
    assert s["rounds"] == 1 and s["reads_per_token"] > 0 and s["ttft_ms_median"] > 0


def test_expert_spans_are_the_expert_tensors_gguf_py_reads(files):
    """The spans every cold proof and drop works on: the routed expert tensors of a stock file and
    the blobs of a packed one, as gguf-py reads them (a packed file's roles are views into the blob;
    counting stride x E from each role's own offset ran into the next layer's dense tensors)."""
    from gguf import GGUFReader

    from mbolt.core.pagecache import expert_spans
    from mbolt.core.moe_map import moe_map

    for f, pat in ((files["stock"], r"ffn_(gate|up|down)_exps"), (files["packed"], r"ffn_exps_packed")):
        want = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
                      for t in GGUFReader(str(f)).tensors if re.search(pat, t.name))
        assert len(want) == (3 * L if f == files["stock"] else L) and expert_spans(moe_map(str(f))) == want


def test_decode_arms_start_with_dense_weights_resident(files):
    """Decode rounds: experts cold (mincore), the dense weights resident and mapped before the clock,
    so the engine takes no major fault in the timed part whatever the layout (cold dense weights
    faulted in with readahead, a cost outside io_s that differed between stock and packed)."""
    res = run_ab([Arm("stock", str(files["stock"])), Arm("packed", str(files["packed"]))], mode="decode",
                 prompts=[[1, 2, 3]], n_new=3, rounds=2, host_cache={})
    assert res.cold and len(res.rounds) == 6
    for r in res.rounds:
        assert r.cold_proven and not r.rejected and r.resident_after <= 0.01, r
        assert r.major_faults == 0, (r.arm, r.major_faults)
        assert "dense weights resident and mapped" in r.note
        assert r.misses > 0 and r.device_bytes is not None and r.device_bytes <= r.bytes + 4096 * r.reads


def test_decode_arms_on_a_split_set_start_with_dense_weights_resident(files, tmp_path):
    """The same cold start over every shard of a set cut by gguf-py's splitter."""
    from _split_util import split_with_gguf_py

    shards = split_with_gguf_py(files["stock"], tmp_path / "set.gguf", max_tensors=8)
    assert len(shards) >= 3
    kw = dict(mode="decode", prompts=[[1, 2, 3]], n_new=3, rounds=2, host_cache={})
    res = run_ab([Arm("set", str(shards[0]))], **kw)
    assert res.cold
    for r in res.rounds:
        assert r.cold_proven and not r.rejected and r.major_faults == 0, r
    one = run_ab([Arm("file", str(files["stock"]))], **kw)  # another fingerprint: its own run
    # the same experts read (reads may differ: slices adjacent across a shard boundary never merge)
    assert res.summary[0]["mb_per_token"] == one.summary[0]["mb_per_token"] > 0


def test_law_by_hand():
    from mbolt.bench.predict import law

    g, sp = law(2, 65536, 100e-6, 1e9, s=0.5)
    assert g == pytest.approx(1 + 2 * 100e-6 / (65536 / 1e9))
    assert sp == pytest.approx(1 / (0.5 + 0.5 / g))


def fake_probe(tmp_path):
    fits = {f"{m}_qd{q}": {"mode": m, "qd": q, "t_op_s": 100e-6 / q, "bw_bytes_s": 1e9 * (1 + (q > 1)),
                           "best_mb_per_s": 1000.0}
            for m in ("buffered", "direct") for q in (1, 4)}
    p = tmp_path / "probe.json"
    p.write_text(json.dumps({"fits": fits, "rows": []}))
    return p


def test_reader_cost_interpolates_by_parallelism(tmp_path):
    from mbolt.bench.predict import reader_cost
    from mbolt.bench.probe import load_probe

    pr = load_probe(fake_probe(tmp_path))
    assert reader_cost(pr, False, 1, 10)[:2] == (100e-6, 1e9)
    assert reader_cost(pr, False, 4, 10)[:2] == pytest.approx((25e-6, 2e9))  # 4 in flight: the QD4 figures
    assert reader_cost(pr, False, 4, 1)[:2] == pytest.approx((100e-6, 1e9))  # one small read: QD1 figures


def test_prediction_counts_equal_store_counts(files, tmp_path):
    """The predictor (evaluator) and the store count the same reads for every arm.

    Experts 0..6 only: in a stock file the last slice of one tensor touches the first slice of
    the next, which the store (one merge over all ranges) joins and the evaluator (per tensor)
    does not; a boundary case of weight 1/E^2 per token that this test keeps out."""
    from mbolt.bench.predict import predict_vs_measured

    tr = rand_trace(n=20, seed=3, n_choices=E - 1)
    res = run_ab([Arm("stock", str(files["stock"])), Arm("packed", str(files["packed"]))], trace=tr, rounds=1,
                 aa=False)
    rows = predict_vs_measured(res, tr, fake_probe(tmp_path))
    for r in rows:
        assert r["pred_reads_per_token"] == pytest.approx(r["meas_reads_per_token"])
        assert r["pred_bytes_per_token"] == pytest.approx(r["meas_bytes_per_token"])


def test_unprovable_eviction_marks_run_not_cold(files, monkeypatch):
    import mbolt.core.pagecache as pc

    def no_mincore(*a, **k):
        raise OSError("mincore not supported here")

    monkeypatch.setattr(pc, "resident_share", no_mincore)
    res = run_ab([Arm("stock", str(files["stock"]))], trace=rand_trace(), rounds=1)
    assert res.cold is False
    assert any("NOT cold" in n for n in res.notes)
    assert all(not r.cold_proven and "mincore unavailable" in r.note for r in res.rounds)


def test_decode_law_non_io_term_by_hand():
    from mbolt.bench.predict import decode_law

    # wall 100 ms: 40 ms I/O, 300 reads; the arm reads 40 ms -> 20 ms in 30 reads: without the
    # non-I/O term it is DESIGN.md's 1/((1-s) + s/g) with s = 0.4, g = 2
    assert decode_law(0.100, 0.040, 300, 0.020, 30) == pytest.approx(1 / (0.6 + 0.4 / 2))
    # 20 us per read outside I/O: other = 100 - 40 - 6 = 54 ms; arm = 54 + 20 + 0.6 = 74.6 ms
    assert decode_law(0.100, 0.040, 300, 0.020, 30, 20e-6) == pytest.approx(0.100 / 0.0746)


def test_non_io_per_read_recovers_a_slope():
    from mbolt.bench.stats import non_io_per_read

    # (wall - io)/token = 2 ms + 25 us * reads/token, exactly
    rounds = [RoundResult("a", k, 0, 0, 0, True, False, 10, 0.01 * 10 + (0.002 + 25e-6 * rp) * 10, 0.01 * 10, 0,
                          int(rp * 10), 0, 0, None, 0, 0, 0) for k, rp in enumerate([10, 50, 100, 300, 341, 38])]
    d = non_io_per_read(rounds)
    assert d["per_read_us"] == pytest.approx(25.0) and d["fixed_ms_per_token"] == pytest.approx(2.0)


def test_probe_bursts_and_host_cache(tmp_path):
    """A small probe: burst rows (k scattered reads back to back) with their fit, and the host-cache
    probe, both recorded; cold before each config, proven by mincore."""
    from mbolt.bench.probe import probe

    d = probe(tmp_path, sizes=(16 << 10, 64 << 10), qds=(1,), modes=("buffered",), size_mb=64, reads_mb=1,
              max_reads=16, repeats=1, burst_k=4, n_bursts=4, burst_span=4 << 20)
    assert [(r["size"], r["k"], r["bursts"]) for r in d["burst_rows"]] == [(16 << 10, 4, 4), (64 << 10, 4, 4)]
    assert all(r["cold_proven"] and r["t_op_us"] > 0 for r in d["burst_rows"])
    assert set(d["burst_fits"]) == {"buffered_qd1"} and d["burst_fits"]["buffered_qd1"]["k"] == 4
    hc = d["host_cache"]
    assert hc["measured"] and hc["guest_eviction_proven"] and hc["reads"] == 64
    assert hc["verdict"].split(":")[0] in ("yes", "not seen") and d["environment"]["host_cache"] == hc
    assert not list(tmp_path.iterdir())  # temp files removed


def test_burst_window_grows_with_read_size(tmp_path):
    """Bursts of 1 MiB reads in a window given as 4 MiB (the default probe's largest size against
    its default window crashed): the window grows to hold k scattered reads, each a distinct range."""
    from mbolt.bench.probe import _burst_config, _make_file

    f = _make_file(tmp_path, 64 << 20)
    r = _burst_config(str(f), 1 << 20, 8, 4, 4 << 20, seed=0)
    assert (r["size"], r["k"], r["bursts"]) == (1 << 20, 8, 1) and r["cold_proven"] and r["t_op_us"] > 0


def test_cost_prefers_burst_figures_for_qd1_buffered(tmp_path):
    from mbolt.bench.probe import cost, load_probe

    p = fake_probe(tmp_path)
    d = json.loads(p.read_text())
    d["burst_fits"] = {"buffered_qd1": {"mode": "buffered", "qd": 1, "k": 8, "t_op_s": 150e-6, "bw_bytes_s": 8e8}}
    p.write_text(json.dumps(d))
    pr = load_probe(p)
    assert cost(pr, False, 1) == (150e-6, 8e8)  # the burst figures
    assert cost(pr, False, 1, bursts=False) == (100e-6, 1e9)  # the random-read figures
    assert cost(pr, True, 1) == (100e-6, 1e9)  # O_DIRECT: no burst figures
    assert cost(pr, False, 4) == (25e-6, 2e9)


def test_ab_environment_records_host_cache(files):
    import mbolt.bench.runners as runners

    runners._HOST_CACHE.clear()
    res = run_ab([Arm("stock", str(files["stock"]))], trace=rand_trace(), rounds=1, aa=False)
    hc = res.environment["host_cache"]
    assert hc["measured"] and "first_over_reread" in hc and "measured_at" in hc


def test_probe_size_below_the_minimum_names_it_and_the_minimum_works(tmp_path):
    """`probe --size-mb 8` failed deep inside with a window error; now the smallest size that works
    is in the message, and that size runs every config (default sizes, 1 MiB reads included)."""
    from typer.testing import CliRunner

    from mbolt.bench.probe import min_file_bytes, probe
    from mbolt.cli import app

    need_mb = -(-min_file_bytes() // (1 << 20))
    r = CliRunner().invoke(app, ["probe", str(tmp_path), "--size-mb", "8", "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and f"give --size-mb {need_mb} or more" in r.output and "Traceback" not in r.output
    d = probe(tmp_path, qds=(1,), modes=("buffered",), size_mb=need_mb, reads_mb=1, max_reads=16, repeats=1,
              n_bursts=2, host_cache=False)
    assert {r["size"] for r in d["burst_rows"]} == {16 << 10, 64 << 10, 256 << 10, 1 << 20}
    assert all(r["bursts"] >= 1 and r["cold_proven"] for r in d["burst_rows"])
