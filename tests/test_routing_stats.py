"""Routing statistics in a co-activation profile's cut (core/routing_stats.py, layout/stats.py):
hand-computed values on small hand-written traces and profiles, the CLI side by side, and the
routing target `synth --routing-like` takes from a profile or a trace."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.mbtrace import write_trace
from mbolt.core.routing_stats import PAIR_TOP, cut_lifts, top_share
from mbolt.core.trace import DECODE, PREFILL, Trace
from mbolt.data import GRANITE_TRACE, QWEN3_30B_PROFILE
from mbolt.synth.routing_like import OVERLAP_VS_HEAT
from mbolt.layout.stats import profile_stats, routing_target, trace_stats

# one layer, 4 experts, k=2, one sequence of 15 decode tokens
SETS = [[0, 1]] * 6 + [[2, 3]] * 6 + [[0, 2]] * 3


def _trace(sets, n_layers=1, phase=None, seq=None, pos=None):
    ex = np.array(sets, np.int16)
    if ex.ndim == 2:
        ex = ex[:, None, :]
    n = len(ex)
    phase = np.full(n, DECODE, np.uint8) if phase is None else np.array(phase, np.uint8)
    return Trace(n_layers, 4, ex.shape[2], ex, phase,
                 np.zeros(n, np.int32) if seq is None else np.array(seq, np.int32),
                 np.arange(n, dtype=np.int32) if pos is None else np.array(pos, np.int32))


def test_cut_statistics_by_hand():
    layer = trace_stats(_trace(SETS))["layers"][0]
    # heat c = [9, 6, 9, 6] of 30 selections; the hottest 10% is ceil(0.4) = 1 expert
    assert math.isclose(layer["top10_share"], 9 / 30)
    p = np.array([9, 6, 9, 6]) / 30
    assert math.isclose(layer["entropy_norm"], float(-(p * np.log2(p)).sum() / 2))
    # pairs (0,1)=6 and (2,3)=6 have lift 6*15/(9*6) = 5/3 and pass the cut; (0,2)=3 is cut by count
    assert layer["cut_pairs"] == 2 and math.isclose(layer["cut_lift_p50"], 5 / 3)
    # neighbours: 5 x 2/2, 0/2, 5 x 2/2, 1/2, 2 x 2/2 over 14 pairs
    overlap = (5 + 0 + 5 + 0.5 + 2) / 14
    heat_overlap = (9 * 8 + 6 * 5 + 9 * 8 + 6 * 5) / (15 * 14 * 2)
    assert math.isclose(layer["overlap"], overlap) and math.isclose(layer["heat_overlap"], heat_overlap)
    assert math.isclose(layer["overlap_vs_chance"], overlap / 0.5)
    assert math.isclose(layer["overlap_vs_heat"], overlap / heat_overlap)
    cut = trace_stats(_trace(SETS))["profile_cut"]
    assert cut["layers"] == 1 and cut["left_out"] == [] and math.isclose(cut["cut_lift_p50"], 5 / 3)


def test_cut_keeps_the_2000_largest_counts():
    rng = np.random.default_rng(0)
    E, n = 80, 10_000
    counts = np.triu(rng.integers(5, 60, (E, E)).astype(float), 1)
    heat = np.full(E, 150.0)  # lift = count * 10000 / 22500 >= 1.5 for count >= 4
    lifts = cut_lifts(counts, heat, n)
    kept = np.sort(counts[np.triu_indices(E, 1)])[::-1][:PAIR_TOP]
    assert len(lifts) == PAIR_TOP
    assert np.allclose(np.sort(lifts)[::-1], kept * n / 150.0**2)
    assert top_share(np.arange(20.0)) == pytest.approx((19 + 18) / 190)  # ceil(2.0) = 2 experts


def test_short_layers_are_left_out_of_the_means():
    """llama.cpp routes a prompt's last layer for its last token only: such a layer is listed but
    not averaged."""
    sets = np.array([[[0, 1], [2, 3]]] * 12, np.int16)
    sets[:-1, 1] = -1
    s = trace_stats(_trace(sets, n_layers=2))
    assert s["profile_cut"]["left_out"] == [1] and s["profile_cut"]["layers"] == 1
    assert s["layers"][1]["tokens"] == 1


def test_phase_selects_tokens_and_neighbours_stay_in_a_phase():
    phase = [PREFILL] * 4 + [DECODE] * 3
    sets = [[0, 1], [0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [0, 2]]
    pre = trace_stats(_trace(sets, phase=phase), phase="prefill")["layers"][0]
    assert pre["tokens"] == 4 and pre["overlap"] == 1.0 and pre["overlap_pairs"] == 3
    dec = trace_stats(_trace(sets, phase=phase), phase="decode")["layers"][0]
    assert dec["tokens"] == 3 and dec["overlap_pairs"] == 2 and dec["overlap"] == 0.75
    both = trace_stats(_trace(sets, phase=phase))["layers"][0]
    assert both["overlap_pairs"] == 5  # not the prefill -> decode step


def _profile(tmp_path):
    prof = {"model": "hand", "quant": "F16", "n_layers": 2, "n_expert_per_layer": 4, "k": 2, "n_decode_tokens": 10,
            "layers": [{"layer": 0, "heat": [8, 6, 4, 2], "pairs": [[0, 1, 5, 2.5], [2, 3, 5, 4.0], [0, 2, 6, 1.5]]},
                       {"layer": 1, "heat": [5, 5, 5, 5], "pairs": []}]}
    p = tmp_path / "coactivation_hand.json"
    p.write_text(json.dumps(prof))
    return p


def test_profile_statistics_by_hand(tmp_path):
    s = profile_stats(_profile(tmp_path))
    l0, l1 = s["layers"]
    assert math.isclose(l0["top10_share"], 8 / 20) and math.isclose(l1["top10_share"], 5 / 20)
    assert math.isclose(l0["cut_lift_p50"], 2.5) and l0["cut_pairs"] == 3 and l1["cut_lift_p50"] is None
    assert l1["entropy_norm"] == 1.0
    assert math.isclose(l0["heat_overlap"], (8 * 7 + 6 * 5 + 4 * 3 + 2 * 1) / (10 * 9 * 2))
    cut = s["profile_cut"]
    assert cut["overlap"] is None and math.isclose(cut["cut_lift_p50"], 2.5)  # layer 1 has no pairs
    assert math.isclose(cut["top10_share"], (8 / 20 + 5 / 20) / 2)


def test_the_published_profile_in_its_own_cut(data_dir):
    """The numbers the issue quotes for Qwen3-30B-A3B (entropy 0.890, lift p50 2.8, hottest 10%
    0.36 over all 48 layers) hold for the 8 layers shipped, within their spread across layers."""
    cut = profile_stats(data_dir / QWEN3_30B_PROFILE)["profile_cut"]
    assert cut["layers"] == 8
    assert abs(cut["entropy_norm"] - 0.890) < 0.01 and abs(cut["cut_lift_p50"] - 2.83) < 0.2
    assert abs(cut["top10_share"] - 0.361) < 0.02


def test_routing_targets(tmp_path, data_dir):
    t = routing_target(_profile(tmp_path))
    assert (t.n_experts, t.k, t.n_tokens) == (4, 2, 10) and list(t.layers()) == [0, 1]
    # a profile has no token order: it is planted with the real Qwen3-30B-A3B trace's reuse
    assert t.overlap_vs_heat is None and (t.reuse.k, t.reuse.slots) == (6, (16, 27, 51))
    tr = tmp_path / "hand.mbtrace"
    write_trace(tr, _trace(SETS))
    t = routing_target(tr)
    assert t.heat[0].tolist() == [9, 6, 9, 6]
    assert t.pairs[0][:, :3].tolist() == [[0, 1, 6], [2, 3, 6]]
    assert t.overlap_vs_heat == pytest.approx(((5 + 0 + 5 + 0.5 + 2) / 14) / ((72 + 30 + 72 + 30) / 420))
    # the default target is granite's own ratio (decode tokens, mean over layers)
    g = trace_stats(data_dir / GRANITE_TRACE, phase="decode")["profile_cut"]
    assert g["overlap_vs_heat"] == pytest.approx(OVERLAP_VS_HEAT, abs=0.005)
    assert g["overlap_vs_chance"] == pytest.approx(0.442 / 0.25, abs=0.01)


def test_cli_side_by_side(tmp_path, data_dir):
    tr = tmp_path / "hand.mbtrace"
    write_trace(tr, _trace(SETS))
    prof = _profile(tmp_path)
    r = CliRunner().invoke(app, ["trace-stats", str(tr), "--profile", str(prof), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert math.isclose(s["profile_cut"]["cut_lift_p50"], 5 / 3)
    assert math.isclose(s["compare"]["profile_cut"]["cut_lift_p50"], 2.5)
    r = CliRunner().invoke(app, ["trace-stats", str(tr), "--profile", str(prof)])
    assert r.exit_code == 0 and "coactivation_hand.json" in r.stdout and "hottest 10% share" in r.stdout
    r = CliRunner().invoke(app, ["trace-stats", str(prof), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["model"] == "hand"
    r = CliRunner().invoke(app, ["trace-stats", str(prof), "--profile", str(prof)])
    assert r.exit_code == 2 and "co-activation profile" in r.output
