"""`mbolt report` draws real PNGs from real results files and refuses what it cannot draw."""

import json
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.plan import save_plan
from mbolt.layout.plan import make_plan
from mbolt.core.mbtrace import write_trace
from mbolt.core.trace import DECODE, Trace

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _is_png(path: Path) -> bool:
    img = mpimg.imread(path)
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[0] > 100 and img.shape[1] > 100


def planted_trace(n=400, L=2, E=16, k=4, seed=0) -> Trace:
    """Tokens choose one of four blocks of four experts that sit far apart in stock order."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(E).reshape(4, 4)
    experts = np.stack([[blocks[rng.integers(4)] for _ in range(L)] for _ in range(n)]).astype(np.int16)
    return Trace(L, E, k, experts, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32), np.arange(n, dtype=np.int32))


def test_heatmap_from_trace_and_plan(tmp_path):
    tr = planted_trace()
    write_trace(tmp_path / "t.mbtrace", tr)
    save_plan(tmp_path / "p.json", make_plan(tr, "tsp", train_frac=1.0))
    out = tmp_path / "heat.png"
    res = CliRunner().invoke(app, ["report", str(tmp_path / "t.mbtrace"), "--plan", str(tmp_path / "p.json"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert _is_png(out)


def test_layout_results_plot(tmp_path):
    out = tmp_path / "layout.png"
    res = CliRunner().invoke(app, ["report", str(RESULTS / "layout.json"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert _is_png(out)


def test_unrecognised_results_file_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    res = CliRunner().invoke(app, ["report", str(bad), "-o", str(tmp_path / "x.png")])
    assert res.exit_code == 2
    assert "unrecognised results file" in res.output
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("layer", [5])
def test_heatmap_layer_out_of_range(tmp_path, layer):
    tr = planted_trace()
    write_trace(tmp_path / "t.mbtrace", tr)
    save_plan(tmp_path / "p.json", make_plan(tr, "tsp", train_frac=1.0))
    res = CliRunner().invoke(app, ["report", str(tmp_path / "t.mbtrace"), "--plan", str(tmp_path / "p.json"),
                                   "--layer", str(layer), "-o", str(tmp_path / "h.png")])
    assert res.exit_code == 2 and f"layer {layer}" in res.output


def test_cache_plot_from_the_granite_trace(tmp_path, data_dir):
    out = tmp_path / "cache.png"
    src = data_dir / "granite3moe.trace.txt"
    res = CliRunner().invoke(app, ["cache", str(src), "--cache-slots", "2,4,8", "--plot", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert _is_png(out)
    sweep = json.loads(res.output)
    # the file the report command reads back is the same sweep
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    res = CliRunner().invoke(app, ["report", str(tmp_path / "sweep.json"), "-o", str(tmp_path / "again.png")])
    assert res.exit_code == 0, res.output
    assert _is_png(tmp_path / "again.png")
