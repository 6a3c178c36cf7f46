"""Formats of the other engines (#21): colibri's ROUTE_TRACE and .coli_usage, iliria's FAROUTE1
and llama.cpp's moe-trace CSV read; the original mbolt's co-activation profile and perms.json,
and .coli_usage written; reorder --align.

The importers are checked against files written here by small writers that follow each
project's own writer line for line (quoted), from the real granite routing (mbolt/data), not
against mbolt's writers.
"""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import needs_llama
from mbolt.cli import app
from mbolt.core.trace import DECODE, PREFILL
from mbolt.trace.formats import detect_format, load_trace, load_usage

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def granite_rows(data_dir) -> np.ndarray:
    """The 64 clean decode tokens of the real granite trace, parsed here: [64, 24 layers, 8]."""
    lines = [[int(x) for x in ln.split()] for ln in (data_dir / "granite3moe.trace.txt").read_text().splitlines()]
    clean = lines[93:]  # lines 0-92 are the corrupt prompt (mbolt/data/README.md)
    assert len(clean) == 64 * 24
    return np.asarray([row[1:] for row in clean]).reshape(64, 24, 8)


# forwards: an 8-row prefill of tokens 0-7, then one decode step per token
FORWARDS = [8] + [1] * 56


def gates_of(tok: int, layer: int, k: int) -> list[float]:
    g = np.linspace(1.0, 0.2, k) + 0.01 * ((tok + layer) % 7)
    return list(g / g.sum())


def colibri_route_trace(truth: np.ndarray) -> str:
    """As colibri's rt_trace / rt_trace_end write it (c/route_trace.h):
    fprintf(rt_fp, "%d %d %d", rt_call, row, layer); fprintf(rt_fp, " %d:%.4f", ids[i], gates[i]);
    rt_call advances once per moe() call (one layer of one forward)."""
    out, call, tok = [], 0, 0
    for S in FORWARDS:
        for layer in range(truth.shape[1]):
            for s in range(S):
                ids = truth[tok + s, layer]
                line = "%d %d %d" % (call, s, layer)
                for e, g in zip(ids, gates_of(tok + s, layer, len(ids))):
                    line += " %d:%.4f" % (e, g)
                out.append(line + "\n")
            call += 1
        tok += S
    return "".join(out)


def iliria_faroute(truth: np.ndarray, version: int = 2) -> bytes:
    """As iliria's patched engine writes it (c/tools/patch_m5max_route_trace.py): header
    "FAROUTE1", u32 version, u32 record_size=24, then (v2) u64 expert_bytes, u32 cache_units,
    u32 lru_per_layer, u32 pinned_units, u32 flags; records <QQHHHH event_id, moe_call_id,
    layer, batch_row, route_rank, expert_id, call by call, row by row, rank by rank."""
    head = b"FAROUTE1" + struct.pack("<II", version, 24)
    if version == 2:
        head += struct.pack("<QIIII", 3 * 64 * 1024, 512, 16, 8, 0)
    recs, event, call, tok = [], 0, 0, 0
    for S in FORWARDS:
        for layer in range(truth.shape[1]):
            for s in range(S):
                for rank, e in enumerate(truth[tok + s, layer]):
                    recs.append(struct.pack("<QQHHHH", event, call, layer, s, rank, int(e)))
                    event += 1
            call += 1
        tok += S
    return head + b"".join(recs)


def test_colibri_route_trace_reads_tokens_phases_and_gates(data_dir, tmp_path):
    truth = granite_rows(data_dir)
    p = tmp_path / "route_trace.txt"
    p.write_text(colibri_route_trace(truth))
    assert detect_format(p) == "colibri-route"
    tr = load_trace(p)
    assert (tr.n_layers, tr.n_experts, tr.k, tr.n_tokens) == (24, 32, 8, 64)
    assert np.array_equal(tr.experts, truth)
    assert (tr.phase[:8] == PREFILL).all() and (tr.phase[8:] == DECODE).all()
    assert tr.pos[:8].tolist() == list(range(8))
    want = np.asarray([[gates_of(t, l, 8) for l in range(24)] for t in range(64)])
    assert np.allclose(tr.weights, want, atol=0.5e-4 + 1e-7)  # printed with %.4f


def test_colibri_route_trace_with_fewer_experts_on_some_lines(data_dir, tmp_path):
    """top-p makes k vary by line: the missing ranks are -1."""
    truth = granite_rows(data_dir)[:3, :2]
    lines = ["%d %d %d" % (i, 0, l) + "".join(" %d:0.1000" % e for e in truth[t, l][: 8 - t])
             for i, (t, l) in enumerate((t, l) for t in range(3) for l in range(2))]
    p = tmp_path / "rt.txt"
    p.write_text("\n".join(lines) + "\n")
    tr = load_trace(p)
    assert tr.k == 8 and tr.n_tokens == 3
    assert (tr.experts[2, :, 6:] == -1).all() and np.array_equal(tr.experts[2, :, :6], truth[2, :, :6])


@pytest.mark.parametrize("version", [2, 1])
def test_iliria_faroute_reads_the_same_tokens(data_dir, tmp_path, version):
    truth = granite_rows(data_dir)
    p = tmp_path / "route.bin"
    p.write_bytes(iliria_faroute(truth, version))
    assert detect_format(p) == "faroute"
    tr = load_trace(p)
    assert np.array_equal(tr.experts, truth) and tr.weights is None
    assert (tr.phase[:8] == PREFILL).all() and (tr.phase[8:] == DECODE).all()


def test_llama_moe_trace_csv_equals_the_nuthatch_export_of_the_same_run(data_dir, tmp_path):
    """The granite file is llama.cpp's ffn_moe_topk read contiguously, 8 ids per line, the
    prompt garbled by the strided view: the moe-trace example writes the same ids as
    fprintf("%d,%d\\n", il, ids[i]) one per line. Both must give the same trace."""
    src = data_dir / "granite3moe.trace.txt"
    csv = "".join("%d,%d\n" % (int(v[0]), int(e)) for v in (ln.split() for ln in src.read_text().splitlines())
                  for e in v[1:])
    p = tmp_path / "moe_trace.csv"
    p.write_text(csv)
    assert detect_format(p) == "moe-csv"
    a, b = load_trace(p), load_trace(src)
    assert a.k == 8 and np.array_equal(a.experts, b.experts) and np.array_equal(a.phase, b.phase)
    assert np.array_equal(a.experts[a.phase == DECODE], granite_rows(data_dir))
    assert any("strided top-k view" in n for n in a.notes)


def colibri_usage(heat: np.ndarray, engine_name: str) -> str:
    """As colibri's usage save writes it: fprintf(f, "-1 %d %d\\n", rt_nl, rt_ne);
    fprintf(f, "-2 %d %u\\n", RT_FORMAT_VERSION, rt_id); then "%d %d %u\\n" per non-zero count;
    rt_id = FNV-1a-32 of the engine name."""
    h = 2166136261
    for c in engine_name.encode():
        h = ((h ^ c) * 16777619) % 2**32
    out = "-1 %d %d\n" % heat.shape + "-2 %d %u\n" % (1, h)
    for l in range(heat.shape[0]):
        for e in range(heat.shape[1]):
            if heat[l, e]:
                out += "%d %d %u\n" % (l, e, heat[l, e])
    return out


def test_coli_usage_read_write_and_colibri_engine_ids(tmp_path):
    from mbolt.trace.formats.colibri import engine_id, usage_text

    # ids colibri's engines put in the header (FNV-1a-32 of the engine name)
    assert engine_id("qwen3_moe") == 1574814359 and engine_id("glm_moe_dsa") == 3815245270
    heat = np.zeros((5, 8), np.int64)
    heat[0, 3], heat[2, 7], heat[4, 0] = 5, 9, 1
    p = tmp_path / "x.coli_usage"
    p.write_text(colibri_usage(heat, "olmoe"))
    assert detect_format(p) == "coli-usage"
    u = load_usage(p)
    assert np.array_equal(u.heat, heat) and u.engine_id == 3841822045
    assert usage_text(heat, "olmoe") == p.read_text()  # mbolt writes what colibri writes
    r = run("import-trace", p, "-o", tmp_path / "t.mbtrace")
    assert r.exit_code == 2 and "heat only" in r.output


def test_heat_only_plans_heat_refuses_tsp_and_gives_the_route_map_its_heat(tmp_path):
    from mbolt.core.moe_map import moe_map

    model = tmp_path / "m.gguf"
    assert run("synth", model, "--layers", "3", "--experts", "8", "--k", "2").exit_code == 0
    heat = np.zeros((3, 8), np.int64)
    heat[0] = [1, 9, 3, 0, 0, 7, 2, 5]
    heat[2] = [4, 0, 0, 8, 1, 1, 0, 6]
    usage = tmp_path / "m.coli_usage"
    usage.write_text(colibri_usage(heat, "qwen3_moe"))
    r = run("plan", usage, "--model", model)
    assert r.exit_code == 2 and "--method tsp" in r.output and "--method heat" in r.output
    r = run("plan", usage, "--model", model, "--method", "heat", "-o", tmp_path / "p.json", "--json")
    assert r.exit_code == 0, r.output
    out = tmp_path / "h.gguf"
    assert run("reorder", model, out, "--plan", tmp_path / "p.json").exit_code == 0
    rm = moe_map(out).route_map
    assert rm.perm[0].tolist() == [1, 5, 7, 2, 6, 0, 3, 4]  # hottest first, ties by id
    assert np.array_equal(rm.heat[0], heat[0][rm.perm[0]]) and np.array_equal(rm.heat[2], heat[2][rm.perm[2]])
    assert rm.perm[1].tolist() == list(range(8))  # no counts: stock order
    assert run("verify", model, out).exit_code == 0


def test_export_heat_is_the_trace_heat(data_dir, tmp_path):
    truth = granite_rows(data_dir)
    p = tmp_path / "g.coli_usage"
    r = run("export-heat", data_dir / "granite3moe.trace.txt", "-o", p, "--colibri-engine", "granite")
    assert r.exit_code == 0, r.output
    want = np.zeros((24, 32))
    for t in range(64):
        for l in range(24):
            want[l, truth[t, l]] += 1
    assert np.array_equal(load_usage(p).heat, want)
    lines = p.read_text().splitlines()
    assert lines[0] == "-1 24 32" and lines[1].startswith("-2 1 ")


def test_export_coact_round_trip(data_dir, tmp_path):
    """Heat and pairs, counted here from the raw routing, equal the export's and what
    synth-trace --like reads back; the keys are the original format's."""
    from mbolt.layout.profile import load_profile

    truth = granite_rows(data_dir)
    out = tmp_path / "coactivation_granite.json"
    r = run("export-coact", data_dir / "granite3moe.trace.txt", "-o", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert {"model", "quant", "n_layers", "n_expert_per_layer", "total_experts", "k", "n_decode_tokens",
            "flat_index", "definitions", "layers"} <= set(d)
    assert (d["n_layers"], d["n_expert_per_layer"], d["k"], d["n_decode_tokens"]) == (24, 32, 8, 64)
    for l in (0, 11, 23):
        rec = d["layers"][l]
        assert set(rec) == {"layer", "heat", "pairs", "clusters", "chain_order", "heat_entropy_bits"}
        heat = np.zeros(32, int)
        C = np.zeros((32, 32), int)
        for t in range(64):
            s = sorted(set(truth[t, l].tolist()))
            heat[s] += 1
            for a in range(len(s)):
                for b in range(a + 1, len(s)):
                    C[s[a], s[b]] += 1
        assert rec["heat"] == heat.tolist()
        want = sorted(([i, j, int(C[i, j]), round(C[i, j] * 64 / (heat[i] * heat[j]), 2)]
                       for i in range(32) for j in range(i + 1, 32)
                       if C[i, j] >= 5 and C[i, j] * 64 / (heat[i] * heat[j]) >= 1.5),
                      key=lambda p: (-p[2], p[0], p[1]))[:2000]
        assert rec["pairs"] == want
        assert sorted(rec["chain_order"]) == list(range(32))
        assert sorted(e for c in rec["clusters"] for e in c) == list(range(32))
    prof = load_profile(out)
    assert np.array_equal(prof.heat[5], d["layers"][5]["heat"])
    assert np.array_equal(prof.pairs[5], np.asarray(d["layers"][5]["pairs"], float).reshape(-1, 4))
    r = run("synth-trace", "--like", out, "-o", tmp_path / "s.mbtrace", "--tokens", "500", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["heat_corr_min"] > 0.5


def test_plan_format_perms_reorders_to_the_same_file(data_dir, tmp_path):
    """perms.json carries the plan's own order: reorder from it writes the bytes reorder from
    plan.json writes; its chain/clique/heat perms are permutations, heat the plan's."""
    from mbolt.core.plan import load_plan

    model = tmp_path / "m.gguf"
    assert run("synth", model, "--layers", "3", "--experts", "16", "--k", "4").exit_code == 0
    tr = tmp_path / "t.mbtrace"
    assert run("trace", model, "-o", tr, "--n-prompts", "40").exit_code == 0
    assert run("plan", tr, "-o", tmp_path / "plan.json").exit_code == 0
    r = run("plan", tr, "--format", "perms", "-o", tmp_path / "perms.json")
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "perms.json").read_text())
    assert {"n_layers", "n_expert", "n_tokens", "layers"} <= set(d)
    for rec in d["layers"]:
        for key in ("clique_perm", "chain_perm", "heat_perm", "perm"):
            assert sorted(rec[key]) == list(range(16))
    plan = load_plan(tmp_path / "plan.json")
    assert np.allclose([rec["heat"] for rec in d["layers"]], plan.heat)
    for name in ("plan", "perms"):
        assert run("reorder", model, tmp_path / f"{name}.gguf", "--plan", tmp_path / f"{name}.json").exit_code == 0
    assert (tmp_path / "plan.gguf").read_bytes() == (tmp_path / "perms.gguf").read_bytes()


def test_perms_of_the_original_without_perm_use_chain_perm(tmp_path):
    from mbolt.core.plan import load_plan

    rng = np.random.default_rng(3)
    layers = [{"layer": l, "clique_perm": rng.permutation(8).tolist(), "chain_perm": rng.permutation(8).tolist(),
               "heat_perm": rng.permutation(8).tolist(), "heat": rng.integers(0, 50, 8).tolist()} for l in range(2)]
    p = tmp_path / "perms.json"
    p.write_text(json.dumps({"n_layers": 2, "n_expert": 8, "n_tokens": 100, "layers": layers}))
    plan = load_plan(p)
    assert plan.perm.tolist() == [rec["chain_perm"] for rec in layers]
    assert plan.heat.tolist() == [rec["heat"] for rec in layers]


def test_reorder_align_64k_pads_packed_slots_and_keeps_every_slice(tmp_path):
    model = tmp_path / "m.gguf"
    assert run("synth", model, "--layers", "2", "--experts", "8", "--k", "2").exit_code == 0
    for layout in ("reorder", "packed"):
        out = tmp_path / f"{layout}.gguf"
        r = run("reorder", model, out, "--identity", "--layout", layout, "--align", "64K", "--json")
        assert r.exit_code == 0, r.output
        rd = gguf.GGUFReader(out)
        assert rd.alignment == 65536
        assert all(t.data_offset % 65536 == 0 for t in rd.tensors)  # gguf-py's own offsets
        if layout == "packed":
            d = json.loads((tmp_path / "packed.gguf.mbolt.json").read_text())["expert_map"]
            starts = [rng[1] for lay in d["layers"] for ex in lay["experts"] for rng in ex[:1]]
            assert all(s % 65536 == 0 for s in starts)  # every slot starts on 64 KiB
        assert run("verify", model, out).exit_code == 0
    r = run("reorder", model, tmp_path / "bad.gguf", "--identity", "--align", "3000")
    assert r.exit_code == 2 and "power of two" in r.output


def test_reorder_writes_the_expert_map_beside_its_output(tmp_path):
    """The sidecar's expert map equals what `mbolt expert-map` writes for the output."""
    model = tmp_path / "m.gguf"
    assert run("synth", model, "--layers", "2", "--experts", "8", "--k", "2").exit_code == 0
    out = tmp_path / "o.gguf"
    assert run("reorder", model, out, "--identity", "--layout", "packed").exit_code == 0
    assert run("expert-map", out, "-o", tmp_path / "map.json").exit_code == 0
    side = json.loads((tmp_path / "o.gguf.mbolt.json").read_text())
    assert side["expert_map"] == json.loads((tmp_path / "map.json").read_text())


@pytest.mark.parametrize("name, content, msg", [
    ("rt.txt", "0 0 1 3:0.5 4:0.5\n0 2 1 3:0.5 4:0.5\n", "line 2: row 2 of call 0, expected row 1"),
    ("rt2.txt", "0 0 1 3:0.5 3:0.5\n", "line 1: expert ids out of range or repeated"),
    ("rt3.txt", "0 0 1 3:0.5 x:0.5\n", "line 1: expected '<call> <row> <layer>"),
    ("m.csv", "0,1\n0,2\n0;3\n", "line 3: expected '<layer>,<expert>'"),
    ("m2.csv", "0,1\n99999999999999999999999,2\n", "line 2: layer 99999999999999999999999 or expert id 2 out of range"),
    ("rt4.txt", "99999999999999999999999 0 1 3:0.5\n", "line 1: call 99999999999999999999999, row 0 or layer 1 out"),
    ("rt5.txt", "0 0 1 3:1e300\n", "line 1: a gate is not a finite number"),
    ("u.coli_usage", "-1 2 8\n-2 1 5\n0 1 4\n0 1 5\n", "line 4: layer 0 expert 1 counted twice"),
    ("u2.coli_usage", "-1 2 8\n-2 1 5\n0 9 4\n", "line 3: layer 0, expert 9 outside the header's 2 layers x 8"),
    ("u3.coli_usage", "-1 2 8\n-2 7 5\n0 1 4\n", "line 2: .coli_usage version 7"),
])
def test_bad_text_inputs_are_one_line_exit_2(tmp_path, name, content, msg):
    p = tmp_path / name
    p.write_text(content)
    cmd = ("plan", p, "--method", "heat") if name.startswith("u") else ("import-trace", p, "-o", tmp_path / "o.mbtrace")
    r = run(*cmd)
    assert r.exit_code == 2, r.output
    assert msg in r.output and str(p) in r.output and "Traceback" not in r.output


def test_bad_faroute_inputs_are_one_line_exit_2(data_dir, tmp_path):
    good = iliria_faroute(granite_rows(data_dir))
    head = 40
    cases = {
        "truncated": (good[:-5], "truncated (19 of 24 bytes)"),
        "gap": (good[:head + 24] + good[head + 48:], "record 1 at byte 64: event_id 2, expected 1"),
        "size": (good[:12] + struct.pack("<I", 32) + good[16:], "record_size 32, expected 24"),
        "version": (good[:8] + struct.pack("<I", 3) + good[12:], "unsupported FAROUTE1 version 3"),
    }
    for name, (raw, msg) in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(raw)
        r = run("import-trace", p, "-o", tmp_path / f"{name}.mbtrace")
        assert r.exit_code == 2 and msg in r.output, (name, r.output)
        assert not (tmp_path / f"{name}.mbtrace").exists()


@needs_llama
def test_llama_cpp_loads_a_64k_aligned_reorder_and_gives_the_stock_logits(tmp_path):
    """general.alignment 65536 is a power of two llama.cpp accepts; the same weights give the
    same logits bit for bit (an identity reorder: same order, same arithmetic)."""
    from mbolt.runtime.runner import LlamaRunner

    model = tmp_path / "m.gguf"
    assert run("synth", model, "--layers", "2", "--experts", "8", "--k", "2").exit_code == 0
    out = tmp_path / "a.gguf"
    assert run("reorder", model, out, "--identity", "--align", "65536").exit_code == 0
    prompt = [104, 101, 108, 108, 111, 32, 116, 104]
    with LlamaRunner(model, n_ctx=64, n_threads=1) as r:
        want = r.eval(prompt, all_logits=True)
    with LlamaRunner(out, n_ctx=64, n_threads=1) as r:
        got = r.eval(prompt, all_logits=True)
    assert np.array_equal(want, got)


def test_export_heat_force_replaces_only_an_earlier_usage_file(data_dir, tmp_path):
    src = data_dir / "granite3moe.trace.txt"
    out = tmp_path / "g.coli_usage"
    assert run("export-heat", src, "-o", out).exit_code == 0
    r = run("export-heat", src, "-o", out)
    assert r.exit_code == 2 and "output exists" in r.output
    assert run("export-heat", src, "-o", out, "--force", "--phase", "all").exit_code == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    r = run("export-heat", src, "-o", notes, "--force")
    assert r.exit_code == 2 and notes.read_text() == "my notes\n"


def test_exports_of_a_trace_without_decode_tokens_name_it(data_dir, tmp_path):
    from mbolt.core.mbtrace import read_trace, write_trace

    model = tmp_path / "m.gguf"
    assert run("synth", model, "--layers", "2", "--experts", "8", "--k", "2").exit_code == 0
    assert run("trace", model, "-o", tmp_path / "t.mbtrace", "--n-prompts", "3").exit_code == 0
    t = read_trace(tmp_path / "t.mbtrace")
    pre = tmp_path / "prefill.mbtrace"
    write_trace(pre, t.select(t.phase == PREFILL))
    r = run("export-coact", pre, "-o", tmp_path / "c.json")
    assert r.exit_code == 2 and "prefill.mbtrace: no decode tokens" in r.output
    r = run("export-heat", pre, "-o", tmp_path / "u.coli_usage")
    assert r.exit_code == 2 and "prefill.mbtrace has no decode tokens (--phase all" in r.output
    assert run("export-heat", pre, "-o", tmp_path / "u.coli_usage", "--phase", "all").exit_code == 0
