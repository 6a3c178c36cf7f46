"""`mbolt plan` and `mbolt synth-trace` end to end, on real and made-up data."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.layout.calibrate import load_profile, structured_trace
from mbolt.core.plan import load_plan
from mbolt.core.mbtrace import read_trace, write_trace
from mbolt.core.trace import DECODE

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_plan_granite_reproduces_design_numbers(data_dir, tmp_path):
    """DESIGN.md: on the granite trace's held-out half, stock 6.37 and the mbolt chain 4.18 runs
    per token-layer; a 2-opt/Or-opt path 3.60."""
    src = data_dir / "granite3moe.trace.txt"
    r = run("plan", src, "-o", tmp_path / "plan.json", "--compare", "--json", "--geometry", "granite3-moe-1b-q8_0")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["split"]["n_train"] == 32 and res["split"]["n_heldout"] == 32
    rows = {row["method"]: row for row in res["compare"]["rows"]}
    runs = {m: rows[m]["heldout"]["runs_per_token_layer"] for m in rows}
    assert runs["stock"] == pytest.approx(6.37, abs=0.005)
    assert runs["mbolt-chain"] == pytest.approx(4.18, abs=0.01)
    assert runs["tsp"] < 3.65
    lb = res["compare"]["bound"]["train"]["reads_per_token"]
    assert lb <= rows["tsp"]["train"]["reads_per_token"] <= 1.05 * lb
    plan = load_plan(tmp_path / "plan.json", n_layers=24, n_experts=32)
    assert plan.method == "tsp" and plan.meta["split"]["n_train"] == 32
    # the saved plan scores what the command reported
    from mbolt.layout.evaluate import evaluate, geometry_preset
    from mbolt.core.trace import split_trace
    from mbolt.trace.formats import load_trace

    _, held, _ = split_trace(load_trace(src))
    ev = evaluate(held, plan.perm, geometry_preset("granite3-moe-1b-q8_0"))
    assert ev["reads_per_token"] == pytest.approx(res["heldout"]["reads_per_token"])


def test_plan_rich_output_and_bad_input(tmp_path):
    tr = structured_trace(n_layers=2, n_experts=16, k=4, n_tokens=200, n_groups=4, seed=3)
    write_trace(tmp_path / "t.mbtrace", tr)
    r = run("plan", tmp_path / "t.mbtrace", "-o", tmp_path / "p.json", "--compare", "--layout", "packed", "--gap", "4096")
    assert r.exit_code == 0, r.output
    assert "mbolt-chain" in r.stdout and "bound" in r.stdout
    r = run("plan", tmp_path / "t.mbtrace", "--method", "magic")
    assert r.exit_code == 2 and "unknown ordering method 'magic'" in r.output
    write_trace(tmp_path / "few.mbtrace", tr.select(np.arange(200) < 3))
    r = run("plan", tmp_path / "few.mbtrace")
    assert r.exit_code == 2 and "too few" in r.output
    write_trace(tmp_path / "empty.mbtrace", tr.select(np.zeros(200, bool)))
    r = run("plan", tmp_path / "empty.mbtrace")
    assert r.exit_code == 2 and "no tokens" in r.output
    r = run("plan", tmp_path / "missing.mbtrace")
    assert r.exit_code == 2 and "not found" in r.output
    r = run("plan", tmp_path / "t.mbtrace", "--geometry", "nope")
    assert r.exit_code == 2 and "unknown geometry preset" in r.output


def test_plan_against_a_model_checks_the_shape(tmp_path):
    from mbolt.synth.synth import SynthConfig, write_synth

    model = write_synth(tmp_path / "m.gguf", SynthConfig(n_layers=2, n_experts=8, n_used=2, hidden=32,
                                                         expert_ff=32, fast_random=True))
    good = structured_trace(n_layers=2, n_experts=8, k=2, n_tokens=60, n_groups=2, seed=1)
    write_trace(tmp_path / "good.mbtrace", good)
    r = run("plan", tmp_path / "good.mbtrace", "--model", model, "--json")
    assert r.exit_code == 0, r.output
    g = json.loads(r.stdout)["geometry"]
    assert g["slice_bytes"] == [32 * 32 * 4] * 3  # F32 gate/up/down slices of this model
    bad = structured_trace(n_layers=2, n_experts=16, k=2, n_tokens=60, n_groups=2, seed=1)
    write_trace(tmp_path / "bad.mbtrace", bad)
    r = run("plan", tmp_path / "bad.mbtrace", "--model", model)
    # another geometry: an error naming the trace, before any work
    assert r.exit_code == 2 and "bad.mbtrace: trace is for 2 layers x 16 experts" in r.output
    assert "m.gguf has 2 x 8" in r.output
    # same geometry, another fingerprint: one warning, and the plan is made
    good.fingerprint = "00" * 16
    write_trace(tmp_path / "other.mbtrace", good)
    r = run("plan", tmp_path / "other.mbtrace", "--model", model, "-o", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert "warning: " in r.output and "other.mbtrace: trace was recorded on a model with fingerprint 000000000000" in r.output
    assert (tmp_path / "p.json").exists()


def tiny_profile(path, E=16, k=4, N=3000, seed=0):
    """A profile in the published JSON shape, made from a planted trace we control."""
    from mbolt.layout.coact import coactivation

    tr = structured_trace(n_layers=2, n_experts=E, k=k, n_tokens=N, n_groups=4, strength=0.75, seed=seed)
    co = coactivation(tr)
    layers = []
    for l in range(2):
        lift = co.lift(l)
        iu, ju = np.triu_indices(E, 1)
        keep = (co.counts[l][iu, ju] >= 5) & (lift[iu, ju] >= 1.5)
        pairs = [[int(i), int(j), int(co.counts[l][i, j]), round(float(lift[i, j]), 2)]
                 for i, j in zip(iu[keep], ju[keep])]
        pairs.sort(key=lambda p: -p[2])
        layers.append({"layer": l, "heat": co.heat[l].astype(int).tolist(), "pairs": pairs,
                       "clusters": [list(range(E))], "chain_order": list(range(E))})
    path.write_text(json.dumps({"model": "tiny", "n_layers": 2, "n_expert_per_layer": E, "k": k,
                                "n_decode_tokens": N, "layers": layers}))
    return path


def test_synth_trace_matches_its_profile(tmp_path):
    prof = tiny_profile(tmp_path / "coactivation_tiny.json")
    r = run("synth-trace", "--like", prof, "-o", tmp_path / "s.mbtrace", "--tokens", 3000, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    tr = read_trace(tmp_path / "s.mbtrace")
    assert tr.n_tokens == 3000 and tr.k == 4 and (tr.phase == DECODE).all()
    # every token has k distinct experts
    s = np.sort(tr.experts, axis=2)
    assert (np.diff(s, axis=2) > 0).all()
    p = load_profile(prof)
    heat = np.stack([np.bincount(tr.experts[:, l].ravel(), minlength=16) for l in range(2)])
    for l in range(2):
        assert np.corrcoef(heat[l], p.heat[l])[0, 1] > 0.97
    pc = rep["published_pairs_count_per_token"]
    assert pc["sampled"] == pytest.approx(pc["published"], rel=0.1)
    lp = rep["pair_lift_percentiles"]
    assert lp["sampled"][2] == pytest.approx(lp["published"][2], rel=0.25)
    r = run("synth-trace", "--like", prof, "-o", tmp_path / "s.mbtrace")
    assert r.exit_code == 2 and "exists" in r.output
    (tmp_path / "junk.json").write_text("{}")
    r = run("synth-trace", "--like", tmp_path / "junk.json", "-o", tmp_path / "x.mbtrace")
    assert r.exit_code == 2 and "malformed" in r.output


def test_structure_none_gives_no_gain_beyond_heat():
    from mbolt.core.trace import split_trace
    from mbolt.layout.plan import compare_methods
    from mbolt.layout.evaluate import Geometry

    tr = structured_trace(n_layers=2, n_experts=32, k=4, n_tokens=3000, structure="none", heat_skew=1.0, seed=4)
    train, held, _ = split_trace(tr)
    res = compare_methods(train, held, Geometry("packed", (1, 1, 1)), bound="none")
    ho = {r["method"]: r["heldout"]["reads_per_token"] for r in res["rows"]}
    # the heat effect is real (hot experts next to each other, hottest in the middle) ...
    assert ho["heat"] < 0.97 * ho["stock"]
    assert ho["heat-tsp"] < 0.98 * ho["heat"]
    # ... but with no co-activation structure, planning on pair counts gains nothing beyond it
    assert ho["tsp"] >= 0.99 * ho["heat-tsp"]


def test_plan_writes_the_heldout_trace_for_ab(tmp_path, data_dir):
    """`mbolt plan --heldout` writes exactly the tokens the plan was not trained on."""
    from typer.testing import CliRunner

    from mbolt.cli import app
    from mbolt.core.mbtrace import read_trace
    from mbolt.trace.formats import load_trace
    from mbolt.core.trace import DECODE

    src = data_dir / "granite3moe.trace.txt"
    out, held_path = tmp_path / "plan.json", tmp_path / "held.mbtrace"
    res = CliRunner().invoke(app, ["plan", str(src), "-o", str(out), "--heldout", str(held_path)])
    assert res.exit_code == 0, res.output
    held = read_trace(held_path)
    decode = load_trace(src)
    decode = decode.select(decode.phase == DECODE)
    assert held.n_tokens == 32  # the second half of granite's 64 decode tokens
    assert (held.experts == decode.experts[32:]).all()
    res = CliRunner().invoke(app, ["plan", str(src), "--train-frac", "1", "--heldout", str(tmp_path / "h2.mbtrace")])
    assert res.exit_code == 2 and "nothing is held out" in res.output


def test_profile_in_the_glm_overlay_shape_reads_as_the_qwen_one(tmp_path):
    """The GLM-5.2 overlay lists MoE layers by moe_order, counts tokens in profile_rows and has a
    fifth pair column: the same numbers in that shape give the same profile."""
    from mbolt.layout.calibrate import load_profile

    qwen = tiny_profile(tmp_path / "coactivation_tiny.json")
    d = json.loads(qwen.read_text())
    glm = {"artifact": "glm-shaped", "n_expert_per_layer": d["n_expert_per_layer"], "k": d["k"],
           "profile_rows": {"used": "decode only", "decode_rows": d["n_decode_tokens"]},
           "layers": [{"abs_layer": rec["layer"] + 3, "moe_order": rec["layer"], "heat": rec["heat"],
                       "pairs": [p + [7] for p in rec["pairs"]], "chain_order": rec["chain_order"]}
                      for rec in reversed(d["layers"])]}
    (tmp_path / "glm.json").write_text(json.dumps(glm))
    a, b = load_profile(qwen), load_profile(tmp_path / "glm.json")
    assert (a.n_layers, a.n_experts, a.k, a.n_tokens) == (b.n_layers, b.n_experts, b.k, b.n_tokens) == (2, 16, 4, 3000)
    assert np.array_equal(a.heat, b.heat) and all(np.array_equal(x, y) for x, y in zip(a.pairs, b.pairs))
    assert len(a.pairs[0]) > 0
