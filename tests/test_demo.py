"""`mbolt demo --size tiny` end to end: what it prints agrees with what it wrote, and the stock
arm's reads/token match an independent count from the file's tensor offsets."""

import json
import re

import numpy as np
from gguf import GGUFReader
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.mbtrace import read_trace


def naive_stock_reads_per_token(model_path, held) -> float:
    """Per token and layer: the selected experts' slices in gate/up/down, merged when they touch."""
    r = GGUFReader(model_path)
    by_name = {t.name: t for t in r.tensors}
    total = 0
    for t in range(held.n_tokens):
        for layer in range(held.n_layers):
            ids = [int(e) for e in held.experts[t, layer] if e >= 0]
            if not ids:
                continue
            ranges = []
            for proj in ("gate", "up", "down"):
                ten = by_name[f"blk.{layer}.ffn_{proj}_exps.weight"]
                size = int(ten.n_bytes) // held.n_experts
                ranges += [(ten.data_offset + e * size, ten.data_offset + (e + 1) * size) for e in ids]
            ranges.sort()
            reads, end = 0, -1
            for s, e in ranges:
                if s > end:
                    reads += 1
                end = max(end, e)
            total += reads
    return total / held.n_tokens


def test_demo_tiny_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wd = tmp_path / "demo"
    # a relative workdir, as the default one: result files must not depend on where it ran
    res = CliRunner().invoke(app, ["demo", "--workdir", "demo", "--size", "tiny"], terminal_width=120)
    assert res.exit_code == 0, res.output
    assert "cli.py:" not in res.output  # plain progress lines, not console.log's caller
    assert "next:" in res.output and "mbolt verify MODEL.gguf" in res.output
    summary = json.loads((wd / "demo.json").read_text())
    ab = json.loads((wd / "ab.json").read_text())

    # every rewritten file verified, bit-identity and routing parity included
    assert summary["verify"] and all(v["ok"] for v in summary["verify"].values())
    assert "routing" in {c["name"] for c in summary["verify"]["packed tsp"]["checks"]}

    # the printed table shows the numbers in demo.json, which are ab.json's medians
    by_arm = {s["arm"]: s for s in ab["summary"]}
    for arm in summary["ab"]["arms"]:
        rounds = [r for r in ab["rounds"] if r["arm"] == arm["arm"] and not r["rejected"]]
        assert arm["reads_per_token"] == sum(r["reads"] for r in rounds) / sum(r["tokens"] for r in rounds)
        assert arm["speedup_vs_stock"] == by_arm[arm["arm"]]["speedup_vs_baseline_median"]
        row = next(line for line in res.output.splitlines() if line.strip().startswith(arm["arm"] + " "))
        assert f"{arm['reads_per_token']:.1f}" in row
        assert f"{arm['speedup_vs_stock']:.2f}" in row
    assert re.search(r"A/A control: [+-]\d+\.\d%", res.output)

    # stock reads/token counted independently from the file's own tensor offsets
    held = read_trace(wd / "held.mbtrace")
    stock = next(a for a in summary["ab"]["arms"] if a["arm"] == "stock")
    assert stock["reads_per_token"] == np.float64(naive_stock_reads_per_token(wd / "model.gguf", held))

    # the planted structure is there to find: the packed tsp file needs far fewer reads
    packed = next(a for a in summary["ab"]["arms"] if a["arm"] == "packed tsp")
    assert packed["reads_per_token"] < 0.5 * stock["reads_per_token"]
    assert summary["ab"]["cold"] is True

    # paths in the result files are relative to them, so `report` works from anywhere
    for name, rel in summary["files"].items():
        assert not rel.startswith("/") and (wd / rel).is_file(), name
    assert all((wd / a["path"]).is_file() for a in ab["arms"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rep = CliRunner().invoke(app, ["report", "../demo/demo.json", "-o", "ab.png"])
    assert rep.exit_code == 0, rep.output
    assert (elsewhere / "ab.png").stat().st_size > 0
    rep = CliRunner().invoke(app, ["report", "../demo/demo.json", "--json"])
    assert rep.exit_code == 0, rep.output
    plotted = json.loads(rep.output)
    assert plotted["kind"] == "ab"
    assert [a["arm"] for a in plotted["arms"]] == [s["arm"] for s in ab["summary"] if s.get("rounds")]
    for a in plotted["arms"]:
        assert a["reads_per_token"] == by_arm[a["arm"]]["reads_per_token"]
