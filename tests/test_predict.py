"""`mbolt predict` and the probe's fit, against counts and formulas computed here by hand.

predict: a synthetic model (stock: gate, up and down in three tensors), a random trace, a plan
with a known perm and a probe JSON with known t_op and bandwidth. Reads per token are counted
here independently: per token and layer, the runs of consecutive file positions among the
selected experts, once per tensor that holds a slice (3 in stock/reorder, 1 packed).
probe: `fit_law` on timings generated from known (t_op, BW) recovers them.
"""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mbolt.bench.predict import predict
from mbolt.bench.probe import cost, fit_law
from mbolt.cli import app
from mbolt.core.plan import Plan, save_plan
from mbolt.core.trace import DECODE, Trace
from mbolt.synth.synth import SynthConfig, write_synth

L, E, K, HIDDEN, FF = 3, 16, 4, 64, 32
SLICE = HIDDEN * FF * 4  # one F32 gate, up or down slice
T_OP, BW = 80e-6, 1.5e9


PERM = np.stack([np.random.default_rng(10 + l).permutation(E) for l in range(L)]).astype(np.int32)


def _trace(n=40, seed=0) -> Trace:
    """Even tokens pick K experts adjacent in PERM's order (what a plan learns), odd ones at random."""
    rng = np.random.default_rng(seed)

    def pick(t, l):
        if t % 2:
            return rng.choice(E, K, replace=False)
        start = rng.integers(0, E - K + 1)
        return PERM[l][start:start + K]

    ex = np.array([[pick(t, l) for l in range(L)] for t in range(n)], np.int16)
    return Trace(L, E, K, ex, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32), np.arange(n, dtype=np.int32))


def _runs(positions) -> int:
    p = np.sort(np.asarray(positions))
    return 1 + int((np.diff(p) != 1).sum())


def _reads_per_token(tr: Trace, perm: np.ndarray, regions: int) -> float:
    pos = np.argsort(perm, axis=1)  # pos[l, e]: where expert e sits
    total = sum(regions * _runs(pos[l][tr.experts[t, l]]) for t in range(tr.n_tokens) for l in range(L))
    return total / tr.n_tokens


def _device_bytes_per_token(model, tr: Trace) -> float:
    """Bytes of whole 4 KiB pages the stock file's reads touch (what the device reads), from the
    tensors' offsets as gguf-py reads them: per token, layer and expert tensor, each run of
    consecutive experts covers pages floor(start / 4096) .. ceil(end / 4096)."""
    from gguf import GGUFReader

    rd = GGUFReader(str(model))
    base = {t.name: int(t.data_offset) for t in rd.tensors}
    total = 0
    for t in range(tr.n_tokens):
        for l in range(L):
            ids = np.sort(tr.experts[t, l])
            runs = np.split(ids, np.flatnonzero(np.diff(ids) != 1) + 1)
            for role in ("gate", "up", "down"):
                b = base[f"blk.{l}.ffn_{role}_exps.weight"]
                for r in runs:
                    a, e = b + int(r[0]) * SLICE, b + (int(r[-1]) + 1) * SLICE
                    total += (-(-e // 4096) - a // 4096) * 4096
    return total / tr.n_tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("predict")
    model = d / "model.gguf"
    write_synth(model, SynthConfig(n_layers=L, n_experts=E, n_used=K, hidden=HIDDEN, expert_ff=FF))
    perm = PERM
    plan = save_plan(d / "plan.json", Plan("test", L, E, perm, np.ones((L, E))))
    fits = {f"{m}_qd{q}": {"mode": m, "qd": q, "t_op_s": T_OP / q, "bw_bytes_s": BW * q}
            for m in ("buffered", "direct") for q in (1, 4)}
    probe = d / "probe.json"
    probe.write_text(json.dumps({"fits": fits, "rows": []}))
    return model, plan, perm, probe


def test_predict_reads_and_times_match_independent_counts(setup):
    model, plan, perm, probe = setup
    tr = _trace()
    d = predict(str(model), str(plan), tr, str(probe))
    rows = {r["layout"]: r for r in d["rows"]}
    ident = np.tile(np.arange(E), (L, 1))
    want = {
        "stock (this file)": _reads_per_token(tr, ident, 3),
        "reorder(test)": _reads_per_token(tr, perm, 3),
        "packed(test)": _reads_per_token(tr, perm, 1),
        "packed(identity)": _reads_per_token(tr, ident, 1),
    }
    assert set(rows) == set(want)
    for name, reads in want.items():
        assert rows[name]["reads_per_token"] == pytest.approx(reads), name
    # the plan's order must matter on this trace, or the test could not tell perms apart
    assert want["reorder(test)"] < want["stock (this file)"]

    # stock reads exactly the selected slices: L * K experts x 3 slices per token
    base = rows["stock (this file)"]
    assert base["bytes_per_token"] == pytest.approx(L * K * 3 * SLICE)
    assert d["t_op_us"] == pytest.approx(T_OP * 1e6) and d["bw_mb_s"] == pytest.approx(BW / 1e6)
    # the device reads whole pages: the synthetic stock file aligns tensors to 32 B, so its slices
    # straddle pages; a rewrite starts every slice on a page (device bytes = bytes)
    dev = _device_bytes_per_token(model, tr)
    assert dev > base["bytes_per_token"] and base["device_bytes_per_token"] == pytest.approx(dev)
    t0 = base["reads_per_token"] * T_OP + dev / BW
    assert base["io_ms_per_token"] == pytest.approx(t0 * 1e3)
    for name, r in rows.items():
        if name != "stock (this file)":
            assert r["device_bytes_per_token"] == r["bytes_per_token"], name
        t = r["reads_per_token"] * T_OP + r["device_bytes_per_token"] / BW
        assert r["io_ms_per_token"] == pytest.approx(t * 1e3), name
        assert r["g_measured_model"] == pytest.approx(t0 / t), name
        assert r["speedup"] == pytest.approx(t0 / t), name  # s = 1: the gain itself
        # the law: g = 1 + saved ops per cold expert * t_op / (expert bytes / BW)
        saved = (base["reads_per_token"] - r["reads_per_token"]) / (L * K)
        assert r["g_law"] == pytest.approx(1 + saved * T_OP / (3 * SLICE / BW)), name


def test_predict_end_to_end_speedup_with_s(setup):
    model, plan, _, probe = setup
    d = predict(str(model), str(plan), _trace(), str(probe), s=0.25)
    for r in d["rows"]:
        g = r["g_measured_model"]
        assert r["speedup"] == pytest.approx(1 / (0.75 + 0.25 / g))


def test_predict_cli_json(setup, tmp_path):
    from mbolt.core.mbtrace import write_trace

    model, plan, _, probe = setup
    tr = tmp_path / "held.mbtrace"
    write_trace(tr, _trace())
    r = CliRunner().invoke(app, ["predict", str(model), "--plan", str(plan), "--trace", str(tr),
                                 "--probe", str(probe), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["rows"][0]["reads_per_token"] == pytest.approx(_reads_per_token(_trace(), np.tile(np.arange(E), (L, 1)), 3))


def _rows(params: dict, sizes, noise=0.0, seed=0) -> list[dict]:
    """Probe rows as `probe` writes them: median latency per read (a read of QD q overlaps q-1
    others, so its latency is q times its share of the time)."""
    rng = np.random.default_rng(seed)
    rows = []
    for (mode, qd), (t_op, bw) in params.items():
        for size in sizes:
            per_read = t_op + size / bw
            lat = qd * per_read * (1 + noise * rng.uniform(-1, 1))
            rows.append({"mode": mode, "qd": qd, "size": size, "t_op_us": lat * 1e6,
                         "mb_per_s": size * qd / lat / 1e6})
    return rows


PARAMS = {("buffered", 1): (90e-6, 1.2e9), ("buffered", 4): (30e-6, 2.5e9),
          ("direct", 1): (60e-6, 1.8e9), ("direct", 4): (20e-6, 3.0e9)}
SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20)


def test_fit_law_recovers_known_t_op_and_bandwidth():
    fits = fit_law(_rows(PARAMS, SIZES))
    assert set(fits) == {"buffered_qd1", "buffered_qd4", "direct_qd1", "direct_qd4"}
    for (mode, qd), (t_op, bw) in PARAMS.items():
        f = fits[f"{mode}_qd{qd}"]
        assert f["t_op_s"] == pytest.approx(t_op, rel=1e-6)
        assert f["bw_bytes_s"] == pytest.approx(bw, rel=1e-6)
        assert cost({"fits": fits}, mode == "direct", qd) == (f["t_op_s"], f["bw_bytes_s"])


def test_fit_law_with_noise_stays_close():
    fits = fit_law(_rows(PARAMS, SIZES + (128 << 10, 512 << 10), noise=0.02, seed=3))
    for (mode, qd), (t_op, bw) in PARAMS.items():
        f = fits[f"{mode}_qd{qd}"]
        assert f["t_op_s"] == pytest.approx(t_op, rel=0.25)
        assert f["bw_bytes_s"] == pytest.approx(bw, rel=0.1)


def test_cost_picks_the_nearest_measured_queue_depth():
    fits = fit_law(_rows(PARAMS, SIZES))
    assert cost({"fits": fits}, False, 3) == pytest.approx(PARAMS[("buffered", 4)])
    assert cost({"fits": fits}, True, 2) == pytest.approx(PARAMS[("direct", 1)])


def test_throttled_layout_law_by_hand():
    """The law on a throttled drive as a prediction, computed by hand. The stock arm measured 300
    reads and 100 MB per token at 1 tok/s; the layout's ratios are 0.5 reads and 0.8 bytes, so the
    reorder file is predicted at 150 reads and 80 MB (its own measured reads are no input); the
    probe's cost is t_op 100 us and 1 GB/s. Cloud profile (3,000 IOPS, 125 MB/s):
    stock max(300 x 1e-4 + 0.1 = 0.13 s, 0.1 s, 0.8 s) = 0.8 s, s = 0.8;
    reorder max(0.015 + 0.08 = 0.095 s, 0.05 s, 0.64 s) = 0.64 s, g = 1.25;
    gain = 1 / (0.2 + 0.8 / 1.25) = 1 / 0.84."""
    from mbolt.bench.predict import throttled_io_s, throttled_layout_law

    assert throttled_io_s(300, 100e6, 3000, 125e6) == pytest.approx(0.8, rel=1e-12)
    assert throttled_io_s(6000, 100e6, 3000, 125e6) == pytest.approx(2.0, rel=1e-12)  # operations bind
    assert throttled_io_s(6000, 100e6, None, 550e6) == pytest.approx(100 / 550, rel=1e-12)  # no IOPS cap
    probe = (100e-6, 1e9)
    law = throttled_layout_law((300, 100e6, 1.0), (0.5, 0.8), probe, 3000, 125e6)
    assert law["predicted_per_token"] == {"reorder_reads": 150.0, "reorder_bytes": pytest.approx(80e6)}
    assert law["io_s_per_token"]["stock"] == pytest.approx(0.8, rel=1e-12)
    assert law["io_s_per_token"]["reorder"] == pytest.approx(0.64, rel=1e-12)
    assert law["s"] == pytest.approx(0.8, rel=1e-12)
    assert law["g"] == pytest.approx(1.25, rel=1e-12)
    assert law["predicted_gain"] == pytest.approx(1 / 0.84, rel=1e-12)
    # no cap: the probe's cost alone. stock 0.13 s, reorder 0.095 s, s = 0.13, g = 0.13 / 0.095;
    # gain = 1 / (0.87 + 0.095) = 1 / 0.965
    free = throttled_layout_law((300, 100e6, 1.0), (0.5, 0.8), probe, None, None)
    assert free["s"] == pytest.approx(0.13, rel=1e-12)
    assert free["predicted_gain"] == pytest.approx(1 / 0.965, rel=1e-12)
    # sata (550 MB/s, no IOPS cap): stock max(0.13, 100/550) = 0.181818 s, reorder 80/550 = 0.145454 s,
    # g = 1.25, gain = 1 / (1 - 100/550 + 80/550) = 1 / (1 - 20/550) = 550 / 530
    sata = throttled_layout_law((300, 100e6, 1.0), (0.5, 0.8), probe, None, 550e6)
    assert sata["predicted_gain"] == pytest.approx(550 / 530, rel=1e-12)
    # an arm slower than its I/O alone allows: s is capped at 1 (all of its time is I/O), gain = g = 2
    assert throttled_layout_law((300, 100e6, 5.0), (0.5, 0.5), probe, 3000, 125e6)["predicted_gain"] == \
        pytest.approx(2.0)


def test_layout_read_ratios_from_the_evaluator(tmp_path):
    """Every token routes to experts 0 and 2 of each of 2 layers (F32 slices of 64 x 32 x 4 =
    8,192 B, 3 roles). Stock: each role's two slices are apart, 2 x 3 x 2 = 12 reads of
    2 x 2 x 3 x 8,192 = 98,304 B, and a converter's 32-byte alignment makes every read straddle
    one page more: 98,304 + 12 x 4,096 = 147,456 device bytes. A reorder file that puts 2 right
    after 0: one run per role, 6 reads, its slices on pages: 98,304 B. Ratios 6/12 and
    98,304/147,456 = 2/3, from the two files' geometry and the trace, never a measurement."""
    from mbolt.bench.predict import layout_read_ratios
    from mbolt.core.moe_map import moe_map
    from mbolt.core.trace import DECODE, Trace
    from mbolt.synth.config import tiny
    from mbolt.synth.synth import write_synth
    from mbolt.rewrite.reorder import reorder

    src = write_synth(tmp_path / "s.gguf", tiny("qwen3moe", n_layers=2, dense_layers=0, expert_type="F32"))
    mm = moe_map(src)
    E = mm.n_experts
    perm = np.array([[0, 2] + [e for e in range(E) if e not in (0, 2)]] * 2, dtype=np.int32)
    reorder(src, tmp_path / "r.gguf", perm, layout="reorder")
    n = 6
    tr = Trace(2, E, 2, np.tile(np.array([[0, 2], [0, 2]], dtype=np.int16), (n, 1, 1)),
               np.full(n, DECODE, np.uint8), np.zeros(n, np.int32), np.arange(n, dtype=np.int32))
    reads, nbytes = layout_read_ratios(tr, mm, moe_map(tmp_path / "r.gguf"))
    assert reads == pytest.approx(0.5)
    assert nbytes == pytest.approx(98304 / 147456)


def test_law_holds_bands():
    from mbolt.bench.predict import law_holds

    assert law_holds(1.15, 1.20) and not law_holds(1.05, 1.20)  # within 10% of the prediction
    assert law_holds(1.04, 1.02) and law_holds(0.96, 0.97) and not law_holds(1.08, 1.02)  # under 5%: 1.00 +- 0.05
    assert not law_holds(None, 1.2) and not law_holds(1.2, None)
