"""The expert map for engines (issue 21, `mbolt expert-map`): its ranges, read with plain pread,
give the bytes gguf-py reads as that original expert's slice of the STOCK file, for a stock,
reorder and packed file and a reordered split set (7 tensors per shard)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.synth.synth import SynthConfig, write_synth

L, E = 3, 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from mbolt.rewrite.reorder import reorder

    d = tmp_path_factory.mktemp("expertmap")
    stock = write_synth(d / "m.gguf", SynthConfig(arch="qwen3moe", n_layers=L, n_experts=E, n_used=2, hidden=64,
                                                  expert_ff=32, expert_type="Q8_0", down_type="Q4_0", seed=9))
    perm = np.stack([np.random.default_rng(l).permutation(E) for l in range(L)]).astype(np.int32)
    out = {"stock": stock}
    for layout in ("reorder", "packed"):
        out[layout] = d / f"{layout}.gguf"
        reorder(stock, out[layout], perm, layout=layout, method="test")
    from mbolt.rewrite.outplan import SplitSpec

    res = reorder(stock, d / "set.gguf", perm, layout="reorder", method="test", split=SplitSpec(max_tensors=7))
    out["split"] = sorted(d.glob("set-*.gguf"))[0]
    assert len(list(d.glob("set-*.gguf"))) > 2, res
    return out


def stock_slices(path) -> dict:
    """gguf-py: (layer, projection, original expert) -> bytes of the stock file's slice."""
    r = GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        if "_exps." in t.name:
            layer, proj = int(t.name.split(".")[1]), t.name.split(".")[2][4:-5]
            data = np.asarray(t.data)
            for e in range(E):
                out[(layer, proj, e)] = data[e].tobytes()
    return out


@pytest.mark.parametrize("kind", ["stock", "reorder", "packed", "split"])
def test_map_ranges_read_the_experts_bytes(files, kind, tmp_path):
    out = tmp_path / "map.json"
    r = CliRunner().invoke(app, ["expert-map", str(files[kind]), "-o", str(out)])
    assert r.exit_code == 0, r.output
    m = json.loads(out.read_text())
    assert m["format"] == "mbolt.expert-map" and m["version"] == 1 and m["n_experts"] == E
    assert m["layout"] == {"stock": "stock", "split": "reorder"}.get(kind, kind)
    want = stock_slices(files["stock"])
    base = files[kind].parent
    fds = [os.open(base / f, os.O_RDONLY) for f in m["files"]]
    try:
        n = 0
        for layer in m["layers"]:
            for e, ranges in enumerate(layer["experts"]):
                for proj, (f, off, size) in zip(layer["projections"], ranges):
                    assert os.pread(fds[f], size, off) == want[(layer["layer"], proj, e)]
                    n += 1
        assert n == L * E * 3
    finally:
        for fd in fds:
            os.close(fd)
    if kind == "split":
        assert len(m["files"]) > 1 and len({f for l in m["layers"] for x in l["experts"] for f, _, _ in x}) > 1


def test_expert_map_needs_an_output_and_never_overwrites_the_model(files, tmp_path):
    r = CliRunner().invoke(app, ["expert-map", str(files["stock"])])
    assert r.exit_code == 2 and "-o map.json" in r.output
    r = CliRunner().invoke(app, ["expert-map", str(files["stock"]), "-o", str(files["stock"]), "--force"])
    assert r.exit_code == 2 and "Traceback" not in r.output
