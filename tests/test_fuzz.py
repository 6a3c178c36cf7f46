"""Property-based fuzzing of every reader: flipped, truncated or random bytes give MboltError or a
valid result, never another exception, never a hang, never a large allocation.

Each example starts from a small valid file (so mutations reach past the magic and checksums
where they can) or from random bytes behind a valid magic. Memory is bounded by measuring the
reader's peak allocation with tracemalloc (numpy reports its buffers to it): inputs are a few
KB, so a reader that sizes an array from a damaged count shows up as a peak far above the
bound. A hang is caught by an alarm far longer than any reader takes (a guard, not a timing).
"""

from __future__ import annotations

import contextlib
import json
import signal
import tracemalloc
import warnings

import numpy as np
import pytest
from badfiles import mbolt_trace_bytes, mbtrace_header, moe_gguf, nuthatch_bin_bytes
from hypothesis import HealthCheck, given, settings
from gguf import GGUFValueType
from hypothesis import strategies as st

from mbolt.core.errors import MboltError

PEAK_BYTES = 64 << 20  # no reader may allocate more than this for a file of a few KB
HANG_S = 20
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
EXAMPLES = {}  # reader -> examples run (the suite's coverage count, printed with -s)


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    if EXAMPLES:
        print("\nfuzzed examples per reader:", json.dumps(EXAMPLES), "total", sum(EXAMPLES.values()))


@contextlib.contextmanager
def _bounded():
    def hang(*_):
        raise AssertionError(f"reader still running after {HANG_S} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert peak < PEAK_BYTES, f"reader allocated {peak / 2**20:.0f} MiB for a few KB of input"


def _check(reader, path, name):
    EXAMPLES[name] = EXAMPLES.get(name, 0) + 1
    with _bounded():
        try:
            return reader(path)
        except MboltError:
            return None


def _mutate(seed: bytes):
    """Strategy: `seed` with up to 8 bytes replaced, then maybe truncated or extended."""
    n = len(seed)
    edits = st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 255)), max_size=8)
    cut = st.one_of(st.none(), st.integers(0, n))
    tail = st.binary(max_size=64)

    def apply(args):
        e, c, t = args
        b = bytearray(seed)
        for i, v in e:
            b[i] = v
        b = bytes(b[:c]) if c is not None else bytes(b)
        return b + t if c is None and t and len(e) % 2 else b

    return st.tuples(edits, cut, tail).map(apply)


# ---- seeds: small valid files ----

def _gguf_seed(tmp):
    return moe_gguf(tmp / "seed.gguf", n_experts=4).read_bytes()


def _mbtrace_seed(tmp):
    from mbolt.core.mbtrace import write_trace
    from mbolt.core.trace import Trace

    rng = np.random.default_rng(1)
    ex = np.stack([np.stack([rng.choice(6, 2, replace=False) for _ in range(2)]) for _ in range(6)]).astype(np.int16)
    tr = Trace(2, 6, 2, ex, np.array([0, 0, 1, 1, 1, 1], np.uint8), np.zeros(6, np.int32),
               np.arange(6, dtype=np.int32), weights=rng.random((6, 2, 2)).astype(np.float32),
               domains={0: "code"}, fingerprint="ab" * 8, notes=["seed"])
    write_trace(tmp / "seed.mbtrace", tr)
    return (tmp / "seed.mbtrace").read_bytes()


def _load_trace(p):
    from mbolt.trace.formats import load_trace

    tr = load_trace(p)
    # a valid result is a consistent one
    assert tr.experts.shape == (tr.n_tokens, tr.n_layers, tr.k)
    assert len(tr.phase) == len(tr.seq) == len(tr.pos) == tr.n_tokens
    if tr.n_tokens:
        assert tr.experts.min() >= -1 and tr.experts.max() < tr.n_experts
    return tr


def _open_gguf(p):
    from mbolt.core.header import read_header
    from mbolt.core.moe_map import moe_map
    from mbolt.core.routemap import expert_ranges, read_route_map

    h = read_header(p)
    for t in h.tensors:
        assert t.data_offset + t.nbytes <= h.file_size
    read_route_map(h)
    m = moe_map(h)
    for layer in m.moe_layers:
        r = expert_ranges(m, layer)
        assert (r[..., 0] + r[..., 1] <= h.file_size).all()
    return m


# ---- GGUF header, MoE map, route map, packed metadata ----


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header(data, tmp_path):
    seed = _gguf_seed(tmp_path)
    p = tmp_path / "x.gguf"
    p.write_bytes(data.draw(_mutate(seed[:400]), "header") + seed[400:])
    _check(_open_gguf, p, "GGUF header + MoE map")


_kv_value = st.one_of(
    st.tuples(st.just(GGUFValueType.UINT32), st.integers(0, 2**32 - 1)),
    st.tuples(st.just(GGUFValueType.INT32), st.integers(-2**31, 2**31 - 1)),
    st.tuples(st.just(GGUFValueType.UINT64), st.integers(0, 2**64 - 1)),
    st.tuples(st.just(GGUFValueType.FLOAT32), st.floats(width=32, allow_nan=True)),
    st.tuples(st.just(GGUFValueType.BOOL), st.booleans()),
    st.tuples(st.just(GGUFValueType.STRING), st.text(max_size=8)),
)
_dim = st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32, 2**63, 2**64 - 1]))


@FUZZ
@given(values=st.fixed_dictionaries({}, optional={k: _kv_value for k in (
           "general.alignment", "qwen3moe.expert_count", "qwen3moe.expert_used_count", "qwen3moe.block_count")}),
       extra=st.lists(st.tuples(st.sampled_from(["blk.0.ffn_gate_exps.weight", "blk.1.attn_q.weight",
                                                 "blk.4095.norm.weight", "blk.99999999.norm.weight",
                                                 "blk.0.ffn_gate_inp.weight", "output.weight"]),
                                st.lists(_dim, min_size=1, max_size=4).map(tuple), st.sampled_from([0, 1, 8, 30])),
                      max_size=3))
def test_fuzz_gguf_fields(values, extra, tmp_path):
    """Any GGUF type and value in the keys mbolt reads, and tensors of any shape and layer index."""
    p = moe_gguf(tmp_path / "x.gguf", n_experts=4, extra_tensors=extra, **values)
    _check(_open_gguf, p, "GGUF fields and shapes")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A packed rewrite of a tiny synthetic model, and the byte ranges of its mbolt.* metadata."""
    from typer.testing import CliRunner

    from mbolt.cli import app
    from mbolt.core.header import read_header
    from mbolt.synth.synth import SynthConfig, write_synth

    d = tmp_path_factory.mktemp("fuzz")
    write_synth(d / "m.gguf", SynthConfig(n_layers=2, n_experts=4, n_used=2, hidden=32, expert_ff=32,
                                          fast_random=True, n_heads=2, n_kv_heads=2, head_dim=16))
    r = CliRunner().invoke(app, ["reorder", str(d / "m.gguf"), str(d / "p.gguf"), "--identity", "--layout", "packed"])
    assert r.exit_code == 0, r.output
    h = read_header(d / "p.gguf")
    spans = [kv.span for k, kv in h.kv.items() if k.startswith("mbolt.") or k.startswith("qwen3moe.")]
    pos = sorted({i for a, b in spans for i in range(a, b)})
    return (d / "p.gguf").read_bytes(), pos, (d / "p.gguf.mbolt.json").read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_packed_and_route_map_metadata(data, packed, tmp_path):
    raw, pos, _ = packed
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 6), "n")):
        b[data.draw(st.sampled_from(pos), "at")] = data.draw(st.integers(0, 255), "v")
    p = tmp_path / "x.gguf"
    p.write_bytes(bytes(b))
    _check(_open_gguf, p, "packed + route-map metadata")


# ---- traces: .mbtrace, MBOLT_TRACE, nuthatch text, NUTHTRC1 ----


@FUZZ
@given(data=st.data())
def test_fuzz_mbtrace(data, tmp_path):
    p = tmp_path / "x.mbtrace"
    p.write_bytes(data.draw(_mutate(_mbtrace_seed(tmp_path)), "bytes"))
    _check(_load_trace, p, ".mbtrace")


@FUZZ
@given(L=st.integers(0, 2**32 - 1), E=st.integers(0, 2**32 - 1), k=st.integers(0, 2**32 - 1),
       flags=st.integers(0, 3), body=st.binary(max_size=512))
def test_fuzz_mbtrace_valid_header_checksum(L, E, k, flags, body, tmp_path):
    """Counts in a header whose checksum is right (the reader cannot lean on the checksum)."""
    p = tmp_path / "x.mbtrace"
    p.write_bytes(mbtrace_header(L, E, k, flags=flags) + body)
    _check(_load_trace, p, ".mbtrace (valid header checksum)")


@FUZZ
@given(text=st.text(alphabet="0123456789  \n\n-x", max_size=400), junk=st.binary(max_size=4))
def test_fuzz_nuthatch_text(text, junk, tmp_path):
    p = tmp_path / "x.txt"
    p.write_bytes(b"0 1 2\n" + text.encode() + junk)
    _check(_load_trace, p, "nuthatch text")

    from mbolt.bench.replay import nuthatch_lines_trace

    _check(nuthatch_lines_trace, p, "nuthatch text (line records)")


def _faroute_bytes() -> bytes:
    import struct

    head = b"FAROUTE1" + struct.pack("<IIQIIII", 2, 24, 4096, 8, 4, 2, 0)
    recs = [(0, 0, 0, 0, 4), (0, 0, 0, 1, 1), (0, 0, 1, 0, 2), (0, 0, 1, 1, 3), (1, 1, 0, 0, 5), (1, 1, 0, 1, 6),
            (2, 0, 0, 0, 1), (2, 0, 0, 1, 2), (3, 1, 0, 0, 0), (3, 1, 0, 1, 7)]
    return head + b"".join(struct.pack("<QQHHHH", i, c, l, r, k, e) for i, (c, l, r, k, e) in enumerate(recs))


def _mbolt_trace_seed() -> bytes:
    return mbolt_trace_bytes(records=[(0, 2, 3, [0, 1, 2, 3, 4, 5]), (1, 2, 3, [1, 2, 3, 4, 5, 6]),
                                      (0, 2, 1, [7, 0]), (1, 2, 1, [2, 3])])


# binary trace formats: (seed, bytes of it kept before a random tail (the magic and more), longest tail)
BINARY_TRACES = {"MBOLT_TRACE": (_mbolt_trace_seed, 12, 600), "NUTHTRC1": (nuthatch_bin_bytes, 8, 400),
                 "FAROUTE1": (_faroute_bytes, 16, 400)}


@pytest.mark.parametrize("fmt", list(BINARY_TRACES))
@FUZZ
@given(data=st.data())
def test_fuzz_binary_trace(fmt, data, tmp_path):
    """The seed mutated, or random bytes behind its first bytes (past the magic)."""
    make, keep, tail = BINARY_TRACES[fmt]
    seed = make()
    p = tmp_path / "x.bin"
    p.write_bytes(data.draw(st.one_of(_mutate(seed), st.binary(max_size=tail).map(lambda b: seed[:keep] + b)),
                            "bytes"))
    _check(_load_trace, p, fmt)


def _text_file(tmp_path, name: str, head: bytes, text: str, big: int, junk: bytes):
    """A text trace: a valid first line, then fuzzed text (each "x" a number of up to 31 digits,
    past int64) and a few junk bytes."""
    p = tmp_path / name
    p.write_bytes(head + text.replace("x", str(big)).encode() + junk)
    return p


_BIG = st.integers(0, 10 ** 30)


def _load_usage(p):
    from mbolt.trace.formats import load_usage

    u = load_usage(p)
    assert u.heat.shape == (u.n_layers, u.n_experts) and (u.heat >= 0).all()
    return u


# text formats: (file name, a valid first line, the fuzzed text's alphabet, reader)
TEXT_FILES = {"colibri ROUTE_TRACE": ("x.txt", b"0 0 1 3:0.5000 4:0.2500\n", "0123456789 :.\n-xe", _load_trace),
              "llama.cpp moe-trace CSV": ("x.csv", b"0,1\n0,2\n", "0123456789,\n-x", _load_trace),
              ".coli_usage": ("x.coli_usage", b"-1 4 8\n-2 1 5\n", "0123456789 \n-x", _load_usage)}


@pytest.mark.parametrize("fmt", list(TEXT_FILES))
@FUZZ
@given(data=st.data(), big=_BIG, junk=st.binary(max_size=4))
def test_fuzz_text_file(fmt, data, big, junk, tmp_path):
    name, head, alphabet, reader = TEXT_FILES[fmt]
    text = data.draw(st.text(alphabet=alphabet, max_size=400), "text")
    _check(reader, _text_file(tmp_path, name, head, text, big, junk), fmt)


def test_coli_usage_naming_the_largest_table_stays_small(tmp_path):
    """A few bytes that name the largest table the limits allow one by one."""
    p = tmp_path / "huge.coli_usage"
    p.write_bytes(b"-1 4000 32000\n4000 31999 1\n")
    _check(_load_usage, p, ".coli_usage")


# ---- JSON files: plan.json, route-map sidecar, probe figures ----

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                       st.text(max_size=5))
_json = st.recursive(_json_leaf, lambda c: st.one_of(st.lists(c, max_size=5),
                                                     st.dictionaries(st.text(max_size=5), c, max_size=5)),
                     max_leaves=20)


def _plan_seed():
    L, E = 2, 4
    return {"format": "mbolt.plan", "version": 1, "method": "heat", "n_layers": L, "n_experts": E,
            "fingerprint": "", "meta": {},
            "layers": [{"layer": i, "perm": list(range(E)), "heat": [0.0] * E} for i in range(L)]}


def _replace_somewhere(d, data):
    """`d` with one value anywhere in it (a field, a list element) replaced by fuzzed JSON."""
    paths = []

    def walk(x, path):
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (k,))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, path + (i,))

    walk(d, ())
    path = data.draw(st.sampled_from(paths), "where")
    value = data.draw(_json, "value")
    if not path:
        return value
    x = d
    for key in path[:-1]:
        x = x[key]
    x[path[-1]] = value
    return d


@FUZZ
@given(data=st.data())
def test_fuzz_plan(data, tmp_path):
    from mbolt.core.plan import load_plan

    p = tmp_path / "plan.json"
    if data.draw(st.booleans(), "bytes?"):
        p.write_bytes(data.draw(_mutate(json.dumps(_plan_seed()).encode()), "bytes"))
    else:
        p.write_text(json.dumps(_replace_somewhere(_plan_seed(), data)))
    plan = _check(load_plan, p, "plan.json")
    if plan is not None:
        assert (np.sort(plan.perm, axis=1) == np.arange(plan.n_experts)).all()


@FUZZ
@given(data=st.data())
def test_fuzz_sidecar(data, packed, tmp_path):
    from mbolt.core.routemap import read_sidecar

    seed = packed[2]
    p = tmp_path / "x.gguf.mbolt.json"
    if data.draw(st.booleans(), "bytes?"):
        p.write_bytes(data.draw(_mutate(seed), "bytes"))
    else:
        p.write_text(json.dumps(_replace_somewhere(json.loads(seed), data)))
    rm = _check(read_sidecar, p, "route-map sidecar")
    if rm is not None:
        assert (np.sort(rm.perm, axis=1) == np.arange(rm.n_experts)).all()


@FUZZ
@given(data=st.data())
def test_fuzz_probe_json(data, tmp_path):
    from mbolt.bench.probe import cost, load_probe

    seed = {"fits": {"buffered_qd1": {"mode": "buffered", "qd": 1, "t_op_s": 1e-4, "bw_bytes_s": 1e9}}}
    p = tmp_path / "probe.json"
    if data.draw(st.booleans(), "bytes?"):
        p.write_bytes(data.draw(_mutate(json.dumps(seed).encode()), "bytes"))
    else:
        p.write_text(json.dumps(_replace_somewhere(seed, data)))
    d = _check(load_probe, p, "probe JSON")
    if d is not None:
        with contextlib.suppress(MboltError):
            cost(d, False, 1)


@pytest.mark.parametrize("fmt", ["mbtrace", "MBOLT_TRACE", "NUTHTRC1", "GGUF"])
def test_every_single_byte_flip(fmt, tmp_path):
    """Exhaustively: every byte of a small valid file set to 0x00, 0xFF and 0x80 in turn. The
    reader refuses it (MboltError) or returns a consistent result; for .mbtrace, whose every byte
    is checksummed, a flip is never read as valid data (only a flip in the LAST record may be
    dropped as a torn tail, with a note, as a crash would leave it)."""
    if fmt == "mbtrace":
        seed, reader, name = _mbtrace_seed(tmp_path), _load_trace, "x.mbtrace"
    elif fmt == "MBOLT_TRACE":
        seed, reader, name = _mbolt_trace_seed(), _load_trace, "x.bin"
    elif fmt == "NUTHTRC1":
        seed, reader, name = nuthatch_bin_bytes(), _load_trace, "x.bin"
    else:
        seed, reader, name = _gguf_seed(tmp_path)[:600], _open_gguf, "x.gguf"
        tail = _gguf_seed(tmp_path)[600:]
    p = tmp_path / name
    for i in range(len(seed)):
        for v in (0x00, 0xFF, 0x80):
            b = bytearray(seed)
            if b[i] == v:
                continue
            b[i] = v
            p.write_bytes(bytes(b) + (tail if fmt == "GGUF" else b""))
            got = _check(reader, p, f"single-byte flips ({fmt})")
            if fmt == "mbtrace" and got is not None:
                assert any("torn last record" in n for n in got.notes), f"byte {i} = {v:#x} read as valid"
