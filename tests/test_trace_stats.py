"""trace-stats: hand-computed statistics on tiny traces, and the CLI on the real granite file."""

from __future__ import annotations

import json
import math

import numpy as np
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.mbtrace import read_trace
from mbolt.core.trace import DECODE, PREFILL, Trace
from mbolt.layout.stats import trace_stats


def _trace(sets, seq=None, phase=None, n_experts=4, domains=None):
    n = len(sets)
    ex = np.array(sets, np.int16)[:, None, :]  # one layer
    return Trace(1, n_experts, ex.shape[2], ex,
                 np.full(n, DECODE, np.uint8) if phase is None else np.array(phase, np.uint8),
                 np.zeros(n, np.int32) if seq is None else np.array(seq, np.int32),
                 np.arange(n, dtype=np.int32), domains=domains or {})


def test_entropy_and_overlap_by_hand():
    s = trace_stats(_trace([[0, 1], [0, 1], [2, 3], [0, 2]]))
    layer = s["layers"][0]
    p = [3 / 8, 2 / 8, 2 / 8, 1 / 8]  # heat of experts 0..3 over 8 routed slots
    h = -sum(x * math.log2(x) for x in p)
    assert math.isclose(layer["entropy_bits"], h) and math.isclose(layer["entropy_norm"], h / 2)
    # overlaps |S_t & S_t+1| / k: 2/2, 0/2, 1/2
    assert math.isclose(layer["overlap"], 0.5) and layer["overlap_pairs"] == 3
    assert layer["pairs"] == 0 and layer["lift_p50"] is None  # no pair seen 5 times


def test_overlap_stays_inside_sequences_and_decode():
    tr = _trace([[0, 1], [0, 1], [0, 1], [0, 1]], seq=[0, 0, 1, 1],
                phase=[PREFILL, DECODE, DECODE, DECODE])
    tr.pos = np.array([0, 1, 0, 1], np.int32)
    layer = trace_stats(tr)["layers"][0]
    assert layer["overlap_pairs"] == 1 and layer["overlap"] == 1.0  # only seq 1, tokens 2->3


def test_lift_percentiles_by_hand():
    sets = [[0, 1]] * 5 + [[2, 3]] * 5 + [[0, 2]] * 5
    layer = trace_stats(_trace(sets))["layers"][0]
    # n=15; counts c0=10 c1=5 c2=10 c3=5; pairs (0,1)=5 (2,3)=5 (0,2)=5
    # lift = C_ij n / (c_i c_j): 5*15/50 = 1.5, 1.5, 5*15/100 = 0.75
    assert layer["pairs"] == 3
    assert math.isclose(layer["lift_p50"], 1.5) and math.isclose(layer["lift_p99"], 1.5)


def test_tokens_sequences_domains():
    tr = _trace([[0, 1], [2, 3], [1, 2]], seq=[0, 0, 1], phase=[PREFILL, DECODE, DECODE],
                domains={0: "code", 1: "code"})
    s = trace_stats(tr)
    assert s["tokens"] == {"total": 3, "prefill": 1, "decode": 2}
    assert s["sequences"] == 2 and s["domains"] == {"code": 2}


def test_cli_on_granite(data_dir, tmp_path):
    src = data_dir / "granite3moe.trace.txt"
    r = CliRunner().invoke(app, ["trace-stats", str(src), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["format"] == "nuthatch-text" and s["tokens"]["decode"] == 64
    assert len(s["layers"]) == 24 and s["layers"][0]["tokens"] == 65  # 64 decode + prompt token 0
    assert any("strided" in n for n in s["notes"])
    out = tmp_path / "g.mbtrace"
    r = CliRunner().invoke(app, ["import-trace", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert read_trace(out).n_tokens == 66
    r = CliRunner().invoke(app, ["import-trace", str(src), "-o", str(out)])
    assert r.exit_code == 2 and "exists" in r.output
    r = CliRunner().invoke(app, ["trace-stats", str(out)])
    assert r.exit_code == 0 and "64 decode" in r.stdout


def test_cli_bad_file(tmp_path):
    p = tmp_path / "junk.bin"
    p.write_bytes(b"\x00\x01junk")
    r = CliRunner().invoke(app, ["trace-stats", str(p)])
    assert r.exit_code == 2 and "unknown trace format" in r.output
