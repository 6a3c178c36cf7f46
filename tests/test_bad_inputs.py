"""Bad inputs across every command: each is refused with exit 2 and ONE line of error output that
names the culprit (file, tensor, layer, line or option), no traceback, nothing left behind in the
working directory and every input unchanged (every file's hash before == after).

Each case runs in a fresh copy of a small working directory (a synthetic model, its trace, a
plan, prompts) and may damage or add files there first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import numpy as np
import pytest
from badfiles import (ARR, STR, U32, flip, set_kv, mbolt_trace_bytes, mbtrace_header, moe_gguf,
                      nuthatch_bin_bytes)
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.header import read_header
from mbolt.core.mbtrace import write_trace
from mbolt.core.moe_map import moe_map
from mbolt.core.trace import DECODE, Trace
from mbolt.synth.synth import SynthConfig, write_synth


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """model.gguf (2 layers x 8 experts, k=2), t.mbtrace routed on it, plan.json, p.txt,
    packed.gguf (a packed rewrite of the model), probe.json."""
    d = tmp_path_factory.mktemp("base")
    write_synth(d / "model.gguf", SynthConfig(n_layers=2, n_experts=8, n_used=2, hidden=64, expert_ff=32))
    write_synth(d / "other.gguf", SynthConfig(n_layers=3, n_experts=4, n_used=2, hidden=64, expert_ff=32))
    mm = moe_map(d / "model.gguf")
    rng = np.random.default_rng(0)
    n = 64
    ex = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(n)]).astype(np.int16)
    write_trace(d / "t.mbtrace", Trace(2, 8, 2, ex, np.full(n, DECODE, np.uint8), np.zeros(n, np.int32),
                                       np.arange(n, dtype=np.int32), fingerprint=mm.source_fingerprint))
    r = CliRunner().invoke(app, ["plan", str(d / "t.mbtrace"), "-o", str(d / "plan.json"), "--model",
                                 str(d / "model.gguf"), "--method", "heat"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["reorder", str(d / "model.gguf"), str(d / "packed.gguf"), "--plan",
                                 str(d / "plan.json"), "--layout", "packed"])
    assert r.exit_code == 0, r.output
    (d / "p.txt").write_text("hello world\n")
    fits = {"buffered_qd1": {"mode": "buffered", "qd": 1, "t_op_s": 1e-4, "bw_bytes_s": 1e9, "best_mb_per_s": 900}}
    (d / "probe.json").write_text(json.dumps({"fits": fits, "rows": []}))
    return d


def _tree(d):
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*"))}


def _plan(w, **change):
    d = json.loads((w / "plan.json").read_text())
    d.update(change)
    return d


def _write(p, data):
    p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return p


def _packed_bad_type(w):
    """packed.gguf with 9999 as the first mbolt.packed.types entry (same size, header rewritten in place)."""
    h = read_header(w / "packed.gguf")
    kv = h.kv["mbolt.packed.types"]
    start, end = kv.span
    raw = bytearray((w / "packed.gguf").read_bytes())
    first = end - 4 * len(kv.value)
    raw[first:first + 4] = struct.pack("<I", 9999)
    (w / "packed.gguf").write_bytes(bytes(raw))
    return ["inspect", str(w / "packed.gguf")], "unknown ggml type 9999"


def _huge_array(w):
    """A u32 array whose count says 2^60 elements (the file holds one)."""
    p = moe_gguf(w / "x.gguf", **{"x.arr": (ARR, np.zeros(1, np.uint32), U32)})
    p.write_bytes(p.read_bytes().replace(struct.pack("<IQ", int(U32), 1), struct.pack("<IQ", int(U32), 1 << 60), 1))
    return p


def _prereg(w, extra_arm=""):
    return _write(w / "x.toml", 'name = "x"\nmode = "replay"\nmetric = "io_s"\nbaseline = "a"\ntreatment = "b"\n'
                  'predicted_speedup = 1.2\npass_threshold = 1.0\n'
                  f'[[arm]]\nname = "a"\nfile = "{w}/model.gguf"\n{extra_arm}'
                  f'[[arm]]\nname = "b"\nfile = "{w}/model.gguf"\n')


def _two_runs(w, argv):
    """Commands whose output must exist first: write it once (must succeed)."""
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    return argv


def _damaged_kernel(w):
    """A kernel-layout file with a byte of its data flipped: the restore refuses it, writes nothing."""
    _two_runs(w, ["repack", str(w / M), str(w / "k.gguf"), "--isa", "avx2"])
    raw = bytearray((w / "k.gguf").read_bytes())
    raw[-100] ^= 1
    (w / "k.gguf").write_bytes(bytes(raw))
    return ["repack", "--restore", str(w / "k.gguf"), str(w / "o.gguf")], "SHA-256"


M, T, P = "model.gguf", "t.mbtrace", "plan.json"

# (id, setup(w) -> (argv, culprit)); paths are inside the working directory w
CASES = [
    # ---- inspect: the GGUF reader ----
    ("inspect-missing", lambda w: (["inspect", str(w / "nope.gguf")], "nope.gguf: no such file")),
    ("inspect-directory", lambda w: (["inspect", str(w)], "is a directory")),
    ("inspect-text", lambda w: (["inspect", str(w / "p.txt")], "not a GGUF")),
    ("inspect-truncated", lambda w: (["inspect", str(_write(w / "cut.gguf", (w / M).read_bytes()[:-4096]))],
                                     "ends past the end of the file")),
    ("inspect-header-cut", lambda w: (["inspect", str(_write(w / "cut.gguf", (w / M).read_bytes()[:200]))],
                                      "truncated GGUF header")),
    ("inspect-ne-wraps-int64", lambda w: (["inspect", str(moe_gguf(
        w / "x.gguf", extra_tensors=[("blk.0.attn_q.weight", (1 << 32, 1 << 32), 0)]))],
        "tensor blk.0.attn_q.weight ends past the end")),
    ("inspect-alignment-string", lambda w: (["inspect", str(moe_gguf(
        w / "x.gguf", **{"general.alignment": (STR, "32")}))], "general.alignment")),
    ("inspect-expert-count-string", lambda w: (["inspect", str(moe_gguf(
        w / "x.gguf", **{"qwen3moe.expert_count": (STR, "8")}))], "qwen3moe.expert_count")),
    ("inspect-block-count-huge", lambda w: (["inspect", str(moe_gguf(
        w / "x.gguf", **{"qwen3moe.block_count": (U32, 33554436)}))], "block_count is 33554436")),
    ("inspect-layer-index-huge", lambda w: (["inspect", str(moe_gguf(
        w / "x.gguf", extra_tensors=[("blk.9999999.norm.weight", (32,), 0)]))],
        "tensor blk.9999999.norm.weight: layer 9999999 is out of range")),
    ("inspect-array-count-huge", lambda w: (["inspect", str(_huge_array(w))], "x.arr: array of")),
    ("inspect-not-moe", lambda w: (["inspect", str(moe_gguf(w / "x.gguf", **{"qwen3moe.expert_count": (U32, 0)}))],
                                   "not a MoE model")),
    ("inspect-experts-huge", lambda w: (["inspect", str(moe_gguf(
        w / "x.gguf", **{"qwen3moe.expert_count": (U32, 1 << 30)}))], "expert_count is 1073741824")),
    ("inspect-packed-bad-type", _packed_bad_type),
    ("inspect-bad-version", lambda w: (["inspect", str(_write(w / "x.gguf", flip((w / M).read_bytes(), 4, 9)))],
                                       "unsupported GGUF version")),
    # ---- synth ----
    ("synth-out-is-dir", lambda w: (["synth", str(w), "--fast-random"], "is a directory")),
    ("synth-out-exists", lambda w: (["synth", str(w / M), "--fast-random"], "output exists")),
    ("synth-force-over-text", lambda w: (["synth", str(w / "p.txt"), "--fast-random", "--force"],
                                         "not a previous synthetic model")),
    ("synth-no-out-dir", lambda w: (["synth", str(w / "no" / "x.gguf"), "--fast-random"], "does not exist")),
    ("synth-layers-zero", lambda w: (["synth", str(w / "x.gguf"), "--layers", "0"], "n_layers must be >= 1")),
    ("synth-k-too-big", lambda w: (["synth", str(w / "x.gguf"), "--experts", "4", "--k", "8"], "larger than")),
    # ---- trace ----
    ("trace-out-is-model", lambda w: (["trace", str(w / M), "-p", str(w / "p.txt"), "-o", str(w / M), "--force"],
                                      "is an input")),
    ("trace-out-is-prompts", lambda w: (["trace", str(w / M), "-p", str(w / "p.txt"), "-o", str(w / "p.txt"),
                                         "--force"], "is an input")),
    ("trace-model-not-gguf", lambda w: (["trace", str(w / "p.txt"), "-p", str(w / "p.txt"), "-o",
                                         str(w / "x.mbtrace")], "not a GGUF")),
    ("trace-prompts-missing", lambda w: (["trace", str(w / M), "-p", str(w / "nope.txt"), "-o",
                                          str(w / "x.mbtrace")], "nope.txt")),
    ("trace-bad-engine", lambda w: (["trace", str(w / M), "-o", str(w / "x.mbtrace"), "--engine", "vllm"],
                                    "--engine")),
    ("trace-kept-part", lambda w: (_write(w / "x.mbtrace.part", (w / T).read_bytes()) and
                                   ["trace", str(w / M), "-p", str(w / "p.txt"), "-o", str(w / "x.mbtrace")],
                                   "x.mbtrace.part")),
    ("trace-negative-tokens", lambda w: (["trace", str(w / M), "-o", str(w / "x.mbtrace"), "-n", "-1"],
                                         "--new-tokens")),
    ("trace-out-is-source-model", lambda w: (["trace", str(w / "packed.gguf"), "-p", str(w / "p.txt"), "-o",
                                              str(w / M), "--force"], "is the model an input was made from")),
    ("trace-out-is-dir", lambda w: (["trace", str(w / M), "-p", str(w / "p.txt"), "-o", str(w)], "is a directory")),
    # ---- trace-stats: every trace reader ----
    ("stats-nuthatch-huge-layer", lambda w: (["trace-stats", str(_write(w / "x.txt", "0 1 2\n2000000000 3 4\n"))],
                                             "line 2")),
    ("stats-nuthatch-not-ascii", lambda w: (["trace-stats", str(_write(w / "x.txt", b"0 1 2\n1 3 \xff\n"))],
                                            "x.txt")),
    ("stats-nuthatch-huge-id", lambda w: (["trace-stats", str(_write(w / "x.txt", "0 1 99999999999999999999\n"))],
                                          "line 1")),
    ("stats-nuthatch-repeat", lambda w: (["trace-stats", str(_write(w / "x.txt", "0 1 1\n"))], "line 1")),
    ("stats-mbolt-flipped-count", lambda w: (["trace-stats", str(_write(w / "x.bin", flip(
        mbolt_trace_bytes(), 12 + 8 + 3, 0x7F)))], "record 0")),
    ("stats-mbolt-k-zero-huge-ntok", lambda w: (["trace-stats", str(_write(w / "x.bin", mbolt_trace_bytes(
        records=[(0, 0, 1 << 30, [])])))], "x.bin")),
    ("stats-mbolt-huge-layer", lambda w: (["trace-stats", str(_write(w / "x.bin", mbolt_trace_bytes(
        records=[(100000, 2, 1, [1, 2])])))], "layer 100000")),
    ("stats-mbolt-bad-id", lambda w: (["trace-stats", str(_write(w / "x.bin", mbolt_trace_bytes(
        records=[(0, 2, 1, [1, 9])])))], "expert id 9")),
    ("stats-mbtrace-huge-layers", lambda w: (["trace-stats", str(_write(w / "x.mbtrace", mbtrace_header(
        268435460, 8, 2)))], "268435460 layers")),
    ("stats-mbtrace-bad-crc", lambda w: (["trace-stats", str(_write(w / "x.mbtrace", flip(
        (w / T).read_bytes(), 100)))], "checksum mismatch")),
    ("stats-mbtrace-bad-header-crc", lambda w: (["trace-stats", str(_write(w / "x.mbtrace", flip(
        (w / T).read_bytes(), 14)))], "header checksum")),
    ("stats-nuthatch-bin-huge-layers", lambda w: (["trace-stats", str(_write(w / "x.bin", nuthatch_bin_bytes(
        n_layers=1 << 31)))], "2147483648 layers")),
    ("stats-nuthatch-bin-truncated", lambda w: (["trace-stats", str(_write(w / "x.bin", nuthatch_bin_bytes()[:-6]))],
                                                "truncated")),
    ("stats-unknown-format", lambda w: (["trace-stats", str(_write(w / "x.bin", b"\x01\x02junk" * 10))],
                                        "unknown trace format")),
    ("stats-bad-format-option", lambda w: (["trace-stats", str(w / T), "--format", "csv"], "'csv'")),
    ("stats-missing", lambda w: (["trace-stats", str(w / "nope.mbtrace")], "nope.mbtrace")),
    # ---- import-trace ----
    ("import-out-is-input", lambda w: (["import-trace", str(_write(w / "x.txt", "0 1 2\n1 3 4\n")), "-o",
                                        str(w / "x.txt"), "--force"], "is an input")),
    ("import-force-over-model", lambda w: (["import-trace", str(_write(w / "x.txt", "0 1 2\n1 3 4\n")), "-o",
                                            str(w / M), "--force"], "not a previous trace")),
    ("import-out-is-dir", lambda w: (["import-trace", str(_write(w / "x.txt", "0 1 2\n")), "-o", str(w)],
                                     "is a directory")),
    ("import-layers-zero", lambda w: (["import-trace", str(_write(w / "x.txt", "0 1 2\n")), "-o",
                                       str(w / "y.mbtrace"), "--layers", "0"], "--layers")),
    ("import-out-exists", lambda w: (["import-trace", str(_write(w / "x.txt", "0 1 2\n")), "-o", str(w / T)],
                                     "output exists")),
    # ---- trace-merge ----
    ("tracemerge-out-is-input", lambda w: (["trace-merge", str(w / T), str(w / T), "-o", str(w / T), "--force"],
                                           "is an input")),
    ("tracemerge-damaged", lambda w: (["trace-merge", str(w / T), str(_write(w / "x.mbtrace", flip(
        (w / T).read_bytes(), 100))), "-o", str(w / "m.mbtrace")], "x.mbtrace")),
    ("tracemerge-other-model", lambda w: (["trace-merge", str(w / T), str(_write(w / "x.txt", "0 1 2\n")), "-o",
                                           str(w / "m.mbtrace")], "x.txt")),
    # ---- synth-trace ----
    ("synthtrace-like-missing", lambda w: (["synth-trace", "--like", str(w / "nope.json"), "-o",
                                             str(w / "x.mbtrace")], "nope.json")),
    ("synthtrace-like-junk", lambda w: (["synth-trace", "--like", str(_write(w / "c.json", "{oops")), "-o",
                                          str(w / "x.mbtrace")], "c.json")),
    ("synthtrace-like-huge", lambda w: (["synth-trace", "--like", str(_write(w / "c.json", json.dumps(
        {"n_layers": 1e13, "n_expert_per_layer": 8, "k": 2, "n_decode_tokens": 9, "layers": []}))), "-o",
        str(w / "x.mbtrace")], "n_layers")),
    ("synthtrace-out-is-like", lambda w: (["synth-trace", "--like", str(_write(w / "c.json", "{}")), "-o",
                                            str(w / "c.json"), "--force"], "is an input")),
    # ---- plan ----
    ("plan-out-is-trace", lambda w: (["plan", str(w / T), "-o", str(w / T)], "is an input")),
    ("plan-heldout-is-trace", lambda w: (["plan", str(w / T), "-o", str(w / "n.json"), "--heldout", str(w / T),
                                          "--force"], "is an input")),
    ("plan-out-is-model", lambda w: (["plan", str(w / T), "-o", str(w / M), "--model", str(w / M), "--force"],
                                     "is an input")),
    ("plan-out-is-traced-model", lambda w: (["plan", str(w / T), "-o", str(w / M), "--force"],
                                            "is the model an input was made from")),
    ("plan-train-frac-zero", lambda w: (["plan", str(w / T), "--train-frac", "0"], "--train-frac")),
    ("plan-train-frac-big", lambda w: (["plan", str(w / T), "--train-frac", "1.5"], "--train-frac")),
    ("plan-gap-negative", lambda w: (["plan", str(w / T), "--gap", "-1"], "--gap")),
    ("plan-bad-method", lambda w: (["plan", str(w / T), "--method", "magic"], "'magic'")),
    ("plan-out-is-heldout", lambda w: (["plan", str(w / T), "-o", str(w / "a"), "--heldout", str(w / "a")],
                                       "both")),
    ("plan-wrong-model", lambda w: (["plan", str(w / T), "--model", str(w / "other.gguf")], "t.mbtrace")),
    ("plan-out-exists", lambda w: (["plan", str(w / T), "-o", str(w / P)], "output exists")),
    # ---- reorder (its inputs; the write path is tested in test_rewrite_safety.py) ----
    ("reorder-plan-layer-string", lambda w: (["reorder", str(w / M), str(w / "o.gguf"), "--plan", str(_write(
        w / "b.json", json.dumps(_plan(w, layers=["x", "y"]))))], "layer 0")),
    ("reorder-plan-experts-huge", lambda w: (["reorder", str(w / M), str(w / "o.gguf"), "--plan", str(_write(
        w / "b.json", json.dumps(_plan(w, n_experts=1e13))))], "n_experts")),
    ("reorder-plan-junk", lambda w: (["reorder", str(w / M), str(w / "o.gguf"), "--plan",
                                      str(_write(w / "b.json", b"\xff\xfe{"))], "b.json")),
    ("reorder-plan-not-perm", lambda w: (["reorder", str(w / M), str(w / "o.gguf"), "--plan", str(_write(
        w / "b.json", json.dumps(_plan(w, layers=[{"perm": [0] * 8}, {"perm": list(range(8))}]))))], "layer 0")),
    ("reorder-plan-wrong-model", lambda w: (["reorder", str(w / "other.gguf"), str(w / "o.gguf"), "--plan",
                                             str(w / P)], "plan")),
    ("reorder-src-missing", lambda w: (["reorder", str(w / "nope.gguf"), str(w / "o.gguf"), "--identity"],
                                       "nope.gguf")),
    ("reorder-bad-layout", lambda w: (["reorder", str(w / M), str(w / "o.gguf"), "--identity", "--layout", "zip"],
                                      "zip")),
    ("reorder-swapped-arguments", lambda w: (["reorder", str(w / "packed.gguf"), str(w / M), "--identity", "--force"],
                                             "is the model an input was made from")),
    ("reorder-out-is-src", lambda w: (["reorder", str(w / M), str(w / M), "--identity", "--force"], "model.gguf")),
    # ---- verify (its inputs and options) ----
    ("verify-out-missing", lambda w: (["verify", str(w / M), str(w / "nope.gguf"), "--no-parity"],
                                      "nope.gguf: no such file")),
    ("verify-src-not-gguf", lambda w: (["verify", str(w / "p.txt"), str(w / "packed.gguf")], "p.txt")),
    ("verify-n-prompts-zero", lambda w: (["verify", str(w / M), str(w / "packed.gguf"), "--n-prompts", "0"],
                                         "--n-prompts")),
    # ---- ab ----
    ("ab-rounds-zero", lambda w: (["ab", str(w / M), "--replay", str(w / T), "--rounds", "0"], "--rounds")),
    ("ab-out-dir-is-file", lambda w: (["ab", str(w / M), "--replay", str(w / T), "--out-dir", str(w / "p.txt")],
                                      "--out-dir")),
    ("ab-no-mode", lambda w: (["ab", str(w / M), "--out-dir", str(w)], "--replay")),
    ("ab-replay-damaged", lambda w: (["ab", str(w / M), "--replay", str(_write(w / "x.mbtrace", flip(
        (w / T).read_bytes(), 100))), "--out-dir", str(w)], "x.mbtrace")),
    ("ab-arm-missing", lambda w: (["ab", str(w / "nope.gguf"), "--replay", str(w / T), "--out-dir", str(w)],
                                  "nope.gguf")),
    ("ab-prereg-junk", lambda w: (["ab", "--prereg", str(_write(w / "x.toml", "name = \n")), "--out-dir", str(w)],
                                  "x.toml")),
    ("ab-prereg-bad-qd", lambda w: (["ab", "--prereg", str(_prereg(w, 'qd = "fast"\n')), "--out-dir", str(w)],
                                    "arm 0 qd")),
    ("ab-threshold-big", lambda w: (["ab", str(w / M), "--replay", str(w / T), "--threshold", "2"], "--threshold")),
    ("ab-result-is-input", lambda w: (["ab", str(w / M), "--replay", str(w / T), "--out-dir", str(w), "--name",
                                       "probe", "--probe", str(w / "probe.json"), "--force"], "is an input")),
    ("ab-name-is-path", lambda w: (["ab", str(w / M), "--replay", str(w / T), "--name", "../x"], "--name")),
    # ---- probe ----
    ("probe-out-is-dir", lambda w: (["probe", str(w / M), "-o", str(w)], "is a directory")),
    ("probe-out-is-input", lambda w: (["probe", str(w / M), "-o", str(w / M), "--force"], "is an input")),
    ("probe-size-zero", lambda w: (["probe", str(w / M), "--size-mb", "0", "-o", str(w / "x.json")], "--size-mb")),
    ("probe-out-under-file", lambda w: (["probe", str(w / M), "-o", str(w / "p.txt" / "x.json")], "is a file")),
    ("probe-file-missing", lambda w: (["probe", str(w / "nope"), "-o", str(w / "x.json")], "nope")),
    # ---- predict ----
    ("predict-probe-junk", lambda w: (["predict", str(w / M), "--trace", str(w / T), "--probe",
                                       str(_write(w / "q.json", "{]"))], "q.json")),
    ("predict-probe-no-fits", lambda w: (["predict", str(w / M), "--trace", str(w / T), "--probe",
                                          str(_write(w / "q.json", "[1, 2]"))], "no fits")),
    ("predict-probe-bad-fit", lambda w: (["predict", str(w / M), "--trace", str(w / T), "--probe", str(_write(
        w / "q.json", json.dumps({"fits": {"f": {"mode": "buffered", "qd": 1, "t_op_s": "fast",
                                                 "bw_bytes_s": 1}}})))], "fit 'f'")),
    ("predict-qd-zero", lambda w: (["predict", str(w / M), "--trace", str(w / T), "--qd", "0"], "--qd")),
    ("predict-s-zero", lambda w: (["predict", str(w / M), "--trace", str(w / T), "--s", "0",
                                   "--probe", str(w / "probe.json")], "--s")),
    ("predict-plan-junk", lambda w: (["predict", str(w / M), "--trace", str(w / T), "--probe", str(w / "probe.json"),
                                      "--plan", str(_write(w / "b.json", "[]"))], "b.json")),
    ("predict-trace-missing", lambda w: (["predict", str(w / M), "--trace", str(w / "nope.mbtrace"), "--probe",
                                          str(w / "probe.json")], "nope.mbtrace")),
    # ---- cache ----
    ("cache-pin-share", lambda w: (["cache", str(w / T), "--pin-share", "5"], "--pin-share")),
    ("cache-slots-zero", lambda w: (["cache", str(w / T), "--cache-slots", "0,4"], "--cache-slots")),
    ("cache-slots-junk", lambda w: (["cache", str(w / T), "--cache-slots", "x"], "--cache-slots")),
    ("cache-train-frac-zero", lambda w: (["cache", str(w / T), "--train-frac", "0"], "--train-frac")),
    ("cache-plot-is-trace", lambda w: (["cache", str(w / T), "--plot", str(w / T), "--force"], "is an input")),
    ("cache-nuthatch-lines-not-ascii", lambda w: (["cache", str(_write(w / "x.txt", b"0 1 2\n\xff\n")),
                                                   "--nuthatch-lines"], "x.txt")),
    # ---- generate ----
    ("generate-hidden-string", lambda w: (["generate", str(set_kv(w / M, w / "x.gguf", "qwen3moe.embedding_length",
                                                                  STR, "64")), "hi"], "qwen3moe.embedding_length")),
    ("generate-heads-zero", lambda w: (["generate", str(set_kv(w / M, w / "x.gguf", "qwen3moe.attention.head_count",
                                                               U32, 0)), "hi"], "qwen3moe.attention.head_count")),
    ("trace-rope-base-string", lambda w: (["trace", str(set_kv(w / M, w / "x.gguf", "qwen3moe.rope.freq_base", STR,
                                                               "fast")), "-p", str(w / "p.txt"), "-o",
                                           str(w / "x.mbtrace")], "qwen3moe.rope.freq_base")),
    ("generate-model-missing", lambda w: (["generate", str(w / "nope.gguf"), "hi"], "nope.gguf")),
    ("generate-tokens-zero", lambda w: (["generate", str(w / M), "hi", "-n", "0"], "--new-tokens")),
    ("generate-bad-route", lambda w: (["generate", str(w / M), "hi", "--route", "both"], "--route")),
    # ---- report ----
    ("report-out-is-src", lambda w: (["report", str(w / "probe.json"), "-o", str(w / "probe.json"), "--force"],
                                     "is an input")),
    ("report-src-junk", lambda w: (["report", str(_write(w / "r.json", "{")), "-o", str(w / "r.png")], "r.json")),
    ("report-src-null", lambda w: (["report", str(_write(w / "r.json", "null")), "-o", str(w / "r.png")],
                                   "r.json: unrecognised results file")),
    ("report-ab-malformed", lambda w: (["report", str(_write(w / "r.json", '{"summary": 5, "rounds": 1, "arms": []}')),
                                        "-o", str(w / "r.png")], "r.json: malformed results file")),
    ("report-cache-malformed", lambda w: (["report", str(_write(w / "r.json", '{"rows": [{"belady": "x"}]}')),
                                           "-o", str(w / "r.png")], "r.json: malformed results file")),
    ("report-out-exists", lambda w: (["report", str(w / "probe.json"), "-o", str(w / "p.txt")], "output exists")),
    ("report-layer-negative", lambda w: (["report", str(w / T), "--plan", str(w / P), "-o", str(w / "r.png"),
                                          "--layer", "-1"], "--layer")),
    ("report-plan-out-is-plan", lambda w: (["report", str(w / T), "--plan", str(w / P), "-o", str(w / P),
                                            "--force"], "is an input")),
    # ---- demo ----
    ("demo-workdir-is-file", lambda w: (["demo", "--workdir", str(w / "p.txt")], "--workdir is a file")),
    ("demo-workdir-not-empty", lambda w: (["demo", "--workdir", str(w)], "not empty")),
    ("demo-bad-size", lambda w: (["demo", "--workdir", str(w / "new"), "--size", "huge"], "'huge'")),
    ("expertmap-missing", lambda w: (["expert-map", str(w / "nope.gguf"), "-o", str(w / "m.json")],
                                     "nope.gguf: no such file")),
    ("expertmap-text", lambda w: (["expert-map", str(w / "p.txt"), "-o", str(w / "m.json")], "not a GGUF")),
    ("expertmap-over-its-model", lambda w: (["expert-map", str(w / M), "-o", str(w / M), "--force"],
                                            "is an input of this command")),
    ("expertmap-no-output", lambda w: (["expert-map", str(w / M)], "give -o map.json")),
    ("exportcoact-text", lambda w: (["export-coact", str(w / "p.txt"), "-o", str(w / "c.json")], "p.txt")),
    ("exportcoact-over-trace", lambda w: (["export-coact", str(w / T), "-o", str(w / T), "--force"],
                                          "is an input of this command")),
    ("exportcoact-other-model", lambda w: (["export-coact", str(w / T), "-o", str(w / "c.json"), "--model",
                                            str(w / "other.gguf")], "3 x 4")),
    ("exportheat-text", lambda w: (["export-heat", str(w / "p.txt"), "-o", str(w / "u.coli_usage")], "p.txt")),
    ("exportheat-over-plan", lambda w: (["export-heat", str(w / T), "-o", str(w / P), "--force"],
                                        "not a previous .coli_usage")),
    ("exportheat-bad-phase", lambda w: (["export-heat", str(w / T), "-o", str(w / "u.coli_usage"), "--phase",
                                         "prefill"], "no prefill tokens")),
    # ---- serve and chat (they fail before listening or reading a line) ----
    ("serve-model-missing", lambda w: (["serve", str(w / "nope.gguf")], "nope.gguf")),
    ("serve-text", lambda w: (["serve", str(w / "p.txt")], "not a GGUF")),
    ("serve-record-over-model", lambda w: (["serve", str(w / M), "--record-routing", str(w / M), "--force"],
                                           "is an input")),
    ("serve-ram-too-small", lambda w: (["serve", str(w / M), "--ram", "1M"], "a budget of 1 MiB cannot hold")),
    ("serve-bad-port", lambda w: (["serve", str(w / M), "--port", "70000"], "--port")),
    ("serve-bad-ram", lambda w: (["serve", str(w / M), "--ram", "lots"], "--ram: 'lots' is not a size")),
    ("chat-model-missing", lambda w: (["chat", str(w / "nope.gguf")], "nope.gguf")),
    ("chat-no-template", lambda w: (["chat", str(w / M), "--ram", "2G"], "no tokenizer.chat_template")),
    ("chat-bad-temp", lambda w: (["chat", str(w / M), "--temp", "9"], "--temp")),
    # ---- repack (the kernel layout) ----
    ("repack-src-missing", lambda w: (["repack", str(w / "nope.gguf"), str(w / "o.gguf"), "--isa", "avx2"],
                                      "nope.gguf: no such file")),
    ("repack-src-text", lambda w: (["repack", str(w / "p.txt"), str(w / "o.gguf"), "--isa", "avx2"], "p.txt")),
    ("repack-out-is-src", lambda w: (["repack", str(w / M), str(w / M), "--isa", "avx2", "--force"], "is an input")),
    ("repack-bad-isa", lambda w: (["repack", str(w / M), str(w / "o.gguf"), "--isa", "neon"], "--isa neon")),
    ("repack-restore-not-kernel", lambda w: (["repack", "--restore", str(w / M), str(w / "o.gguf")],
                                             "not a kernel-layout file")),
    ("repack-restore-with-isa", lambda w: (["repack", "--restore", str(w / M), str(w / "o.gguf"), "--isa", "avx2"],
                                           "--isa")),
    ("repack-restore-damaged", _damaged_kernel),
    ("repack-output-inspected", lambda w: (_two_runs(w, ["repack", str(w / M), str(w / "k.gguf"), "--isa", "avx2"])
                                           and ["inspect", str(w / "k.gguf")], "mbolt repack --restore")),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_cleanly(case, base, tmp_path):
    name, setup = case
    w = tmp_path / "w"
    shutil.copytree(base, w)
    argv, culprit = setup(w)
    before = _tree(w)
    r = CliRunner().invoke(app, argv)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2, (r.exit_code, r.output, repr(r.exception))
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    assert culprit in lines[0], lines[0]
    assert _tree(w) == before  # nothing left behind, every input unchanged


def test_suite_covers_every_command():
    """The bad-input table names every command mbolt has (a new command needs its cases)."""
    from mbolt.cli import COMMANDS

    aliases = {"stats": "trace-stats", "import": "import-trace", "synthtrace": "synth-trace",
               "tracemerge": "trace-merge", "expertmap": "expert-map",
               "exportcoact": "export-coact", "exportheat": "export-heat"}
    covered = {aliases.get(c[0].split("-")[0], c[0].split("-")[0]) for c in CASES}
    assert covered == {n for n, _, _ in COMMANDS}
    assert len(CASES) >= 60


def test_os_error_is_one_line_naming_the_file(tmp_path, capsys):
    """An OSError reaching the CLI (no space left, permission denied) is one line with its file."""
    import errno

    import typer

    from mbolt.cli import user_errors

    @user_errors
    def boom():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.json"))

    with pytest.raises(typer.Exit) as e:
        boom()
    assert e.value.exit_code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"error: {tmp_path / 'out.json'}: No space left on device"]


def test_write_error_names_the_output_and_leaves_nothing(tmp_path):
    """A write that fails mid-way (ENOSPC has no file name) becomes an error naming the output."""
    import errno

    from mbolt.core.atomic import atomic_output
    from mbolt.core.errors import MboltError

    out = tmp_path / "big.bin"
    with pytest.raises(MboltError, match=r"big.bin: No space left on device \(nothing was written"):
        with atomic_output(out) as f:
            f.write(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_gguf_bytes_is_read_back_by_gguf_py(tmp_path):
    """The crafted-file maker writes valid GGUF (gguf-py, an independent reader, agrees)."""
    from gguf import GGUFReader

    p = moe_gguf(tmp_path / "x.gguf")
    r = GGUFReader(p)
    assert [t.name for t in r.tensors] == [f"blk.0.ffn_{x}_exps.weight" for x in ("gate", "up", "down")]
    assert int(r.fields["qwen3moe.expert_count"].parts[-1][0]) == 8
    assert moe_map(p).n_experts == 8
