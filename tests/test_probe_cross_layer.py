"""scripts/probe_cross_layer.py: a layer's misses guessed from the layer before, on a trace whose
answer is known by construction, and on the real route traces the repository carries."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from mbolt.core.trace import DECODE, Trace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_cross_layer.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_cross_layer_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_fixed_link_between_layers_is_found_and_heat_alone_does_not_find_it():
    """Layer 0 cycles through 8 experts, layer 1 always takes layer 0's expert + 3 (mod 8). With one
    slot every selection misses; once each pair was seen, the co-activation guess is always right
    (recall 1, precision 1, nothing read for nothing). Heat guesses the uncached expert used most
    so far: within a cycle that is one just used (its count is one ahead of the next expert's), and
    where the counts are level (a cycle's start: layer 1 takes 3) the lowest uncached id, 0: never right."""
    n = 64
    e0 = np.arange(n) % 8
    experts = np.stack([e0, (e0 + 3) % 8], axis=1)[:, :, None].astype(np.int16)
    trace = Trace(2, 8, 1, experts, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32), np.arange(n, dtype=np.int32))
    r = _probe().replay(trace, slots=1)
    assert r["misses_per_layer_token"] == 1.0
    co, heat = r["predictors"]["co-activation"]["1"], r["predictors"]["heat"]["1"]
    assert (co["recall"], co["precision"], co["extra_per_miss"]) == (1.0, 1.0, 0.0)
    assert (heat["recall"], heat["precision"], heat["extra_per_miss"]) == (0.0, 0.0, 1.0)


def test_the_real_route_traces_replay(tmp_path):
    out = tmp_path / "cross.json"
    assert _probe().main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["routing"]
    assert set(rows) == {"qwen3-30b-a3b (top-6)", "gemma-4-26b-a4b (top-6)", "gpt-oss-120b (top-2)"}
    q = rows["qwen3-30b-a3b (top-6)"]
    assert (q["layers"], q["experts"], q["k"], q["decode_tokens"]) == (48, 128, 6, 128)
    for r in rows.values():
        for p in r["predictors"]["co-activation"].values():
            assert 0 <= p["recall"] <= 1 and 0 <= p["precision"] <= 1
