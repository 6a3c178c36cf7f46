"""Importers: the real granite nuthatch trace, MBOLT_TRACE and NUTHTRC1, and broken files."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mbolt.core.errors import MboltError
from mbolt.core.mbtrace import read_trace, write_trace
from mbolt.trace.formats import detect_format, load_trace
from mbolt.core.trace import DECODE, PREFILL


def _raw_lines(path):
    """The granite file parsed independently: list of (layer, [8 ids])."""
    out = []
    for line in path.read_text().splitlines():
        v = [int(x) for x in line.split()]
        out.append((v[0], v[1:]))
    return out


# ---- the real granite-moe trace ----------------------------------------------------------


@pytest.fixture(scope="module")
def granite(data_dir):
    path = data_dir / "granite3moe.trace.txt"
    return path, load_trace(path), _raw_lines(path)


def test_granite_shape_and_decode_tokens(granite):
    path, tr, raw = granite
    assert detect_format(path) == "nuthatch-text"
    assert (tr.n_layers, tr.n_experts, tr.k) == (24, 32, 8)
    dec = tr.phase == DECODE
    assert int(dec.sum()) == 64
    assert (tr.experts[dec] >= 0).all()  # every decode token has all 24 layers x 8
    assert tr.pos[dec].tolist() == list(range(4, 68))  # 4 prompt tokens come first
    assert (tr.seq == 0).all()
    # decode token j, layer l is raw line 93 + 24 * j + l (0-based)
    for j, layer in [(0, 0), (0, 23), (17, 5), (63, 23)]:
        lay, ids = raw[93 + 24 * j + layer]
        assert lay == layer
        assert tr.experts[dec][j, layer].tolist() == ids


def test_granite_prompt_rows(granite):
    _, tr, raw = granite
    pre = tr.phase == PREFILL
    assert int(pre.sum()) == 2 and tr.pos[pre].tolist() == [0, 3]
    first, last = tr.experts[pre]
    # prompt token 0: the first of each layer's 4 corrupt lines is its real top-8 (layers 0-22)
    for layer in range(23):
        lay, ids = raw[4 * layer]
        assert lay == layer and first[layer].tolist() == ids
    assert (first[23] == -1).all()
    # the output token (position 3) is routed only by the last layer: the lone layer-23 line
    assert raw[92][0] == 23 and last[23].tolist() == raw[92][1]
    assert (last[:23] == -1).all()
    # the 3 other lines of each layer (full rankings) were dropped and the trace says so
    assert any("strided top-k view" in n and "dropped 69" in n for n in tr.notes)
    # the corrupt block really is one full ranking per layer (what the detector relies on)
    for layer in range(23):
        ranking = sum((raw[4 * layer + i][1] for i in range(4)), [])
        assert sorted(ranking) == list(range(32))


def test_granite_round_trips_through_mbtrace(granite, tmp_path):
    _, tr, _ = granite
    write_trace(tmp_path / "g.mbtrace", tr)
    back = read_trace(tmp_path / "g.mbtrace")
    np.testing.assert_array_equal(back.experts, tr.experts)
    assert back.notes == tr.notes and load_trace(tmp_path / "g.mbtrace").n_tokens == 66


# ---- the strided bug, generically ----------------------------------------------------------


def _rankings(rng, T, E):
    return np.argsort(rng.random((T, E)), axis=1)


def test_strided_bug_detected_on_synthetic_export(tmp_path):
    rng = np.random.default_rng(3)
    L, E, k, T = 3, 16, 4, 8
    ranks = [_rankings(rng, T, E) for _ in range(L)]
    lines = []
    for layer in range(L):  # buggy export: T*k ids read contiguously = rankings of tokens 0, 1
        flat = ranks[layer].ravel()[: T * k]
        lines += [f"{layer} " + " ".join(map(str, flat[i * k:(i + 1) * k])) for i in range(T)]
    decode = [_rankings(rng, 1, E)[0, :k] for _ in range(L)]
    lines += [f"{layer} " + " ".join(map(str, decode[layer])) for layer in range(L)]
    p = tmp_path / "bug.txt"
    p.write_text("\n".join(lines) + "\n")
    tr = load_trace(p)
    assert tr.phase.tolist() == [PREFILL, PREFILL, DECODE] and tr.pos.tolist() == [0, 1, 8]
    for layer in range(L):
        assert tr.experts[0, layer].tolist() == ranks[layer][0, :k].tolist()
        assert tr.experts[1, layer].tolist() == ranks[layer][1, :k].tolist()
        assert tr.experts[2, layer].tolist() == decode[layer].tolist()
    assert any("strided" in n for n in tr.notes)


def test_clean_prefill_is_not_flagged(tmp_path):
    rng = np.random.default_rng(4)
    L, E, k, T = 3, 16, 4, 8
    lines, top = [], []
    for layer in range(L):
        t = _rankings(rng, T, E)[:, :k]
        top.append(t)
        lines += [f"{layer} " + " ".join(map(str, row)) for row in t]
    p = tmp_path / "clean.txt"
    p.write_text("\n".join(lines))
    tr = load_trace(p)
    assert tr.n_tokens == T and (tr.phase == PREFILL).all() and tr.notes == []
    assert tr.experts[5, 2].tolist() == top[2][5].tolist()


# ---- MBOLT_TRACE -----------------------------------------------------------------------------


def _mbolt_bytes(n_expert, records, magic=0x544C424D, version=1) -> bytes:
    out = struct.pack("<Iii", magic, version, n_expert)
    for layer, k, rows in records:
        rows = np.asarray(rows, np.int32).reshape(-1, k)
        out += struct.pack("<iii", layer, k, len(rows)) + rows.astype("<i4").tobytes()
    return out


def test_mbolt_prefill_and_decode(tmp_path):
    E, k = 8, 2
    prompt = [  # pass 0: 3 tokens at layers 0, 1; the last layer routes only the output token
        (0, k, [[0, 1], [2, 3], [4, 5]]),
        (1, k, [[1, 0], [3, 2], [5, 4]]),
        (2, k, [[7, 6]]),
    ]
    dec = [(0, k, [[6, 7]]), (1, k, [[5, 6]]), (2, k, [[0, 7]])]
    second = [(0, k, [[3, 4], [5, 6]]), (1, k, [[0, 2], [1, 3]]), (2, k, [[2, 4]])]
    p = tmp_path / "run.bin"
    p.write_bytes(_mbolt_bytes(E, prompt + dec + dec + second + dec))
    assert detect_format(p) == "mbolt"
    tr = load_trace(p)
    assert (tr.n_layers, tr.n_experts, tr.k, tr.n_tokens) == (3, 8, 2, 3 + 1 + 1 + 2 + 1)
    assert tr.phase.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert tr.seq.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert tr.pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert tr.experts[0].tolist() == [[0, 1], [1, 0], [-1, -1]]
    assert tr.experts[2].tolist() == [[4, 5], [5, 4], [7, 6]]  # last layer aligned to the end
    assert tr.experts[3].tolist() == [[6, 7], [5, 6], [0, 7]]
    assert tr.experts[6].tolist() == [[5, 6], [1, 3], [2, 4]]
    assert tr.notes == []


def test_mbolt_errors(tmp_path):
    p = tmp_path / "m.bin"
    good = [(0, 2, [[0, 1]]), (1, 2, [[2, 3]])]
    p.write_bytes(_mbolt_bytes(8, good, magic=0x12345678))
    with pytest.raises(MboltError, match="unknown trace format"):
        load_trace(p)
    with pytest.raises(MboltError, match=r"m\.bin: bad MBOLT_TRACE magic 0x12345678"):
        load_trace(p, fmt="mbolt")
    data = _mbolt_bytes(8, good)
    p.write_bytes(data[:-4])  # last record loses an id
    with pytest.raises(MboltError, match=r"m\.bin: record 1 at byte 32: truncated"):
        load_trace(p)
    p.write_bytes(data[:-2])
    with pytest.raises(MboltError, match=r"m\.bin: 2 stray bytes"):
        load_trace(p)
    p.write_bytes(_mbolt_bytes(8, [(0, 2, [[0, 1]]), (1, 2, [[2, 8]])]))
    with pytest.raises(MboltError, match=r"m\.bin: record 1 at byte 32: expert id 8 out of range"):
        load_trace(p)
    p.write_bytes(_mbolt_bytes(4, [(0, 2, [[0, 1]]), (1, 5, [[0, 1, 2, 3, 0]])]))
    with pytest.raises(MboltError, match=r"m\.bin: record 1 at byte 32: k=5 is larger than the "
                                         r"number of experts \(4\)"):
        load_trace(p)
    p.write_bytes(_mbolt_bytes(8, good, version=2))
    with pytest.raises(MboltError, match="unsupported MBOLT_TRACE version 2"):
        load_trace(p)


# ---- NUTHTRC1 --------------------------------------------------------------------------------


def _nuth_bytes(n_layers, n_expert, records, n_records=None, magic=b"NUTHTRC1") -> bytes:
    out = magic + struct.pack("<IIIQ", 1, n_layers, n_expert,
                              len(records) if n_records is None else n_records)
    for token, layer, ids in records:
        out += struct.pack("<III", token, layer, len(ids)) + np.asarray(ids, "<u4").tobytes()
    return out


def test_nuthatch_bin_token_major(tmp_path):
    # as nuthatch's GreedyGenerateCachedTrace writes it: token = position, token-major
    recs = [(t, layer, [(t + layer) % 6, (t + layer + 1) % 6]) for t in range(5)
            for layer in range(2)]
    p = tmp_path / "n.trace"
    p.write_bytes(_nuth_bytes(2, 6, recs))
    assert detect_format(p) == "nuthatch-bin"
    tr = load_trace(p, prefill_tokens=2)
    assert (tr.n_layers, tr.n_experts, tr.k, tr.n_tokens) == (2, 6, 2, 5)
    assert tr.pos.tolist() == [0, 1, 2, 3, 4] and tr.phase.tolist() == [0, 0, 1, 1, 1]
    assert tr.experts[4].tolist() == [[4, 5], [5, 0]]
    assert any("does not mark the prompt" in n for n in load_trace(p).notes)


def test_nuthatch_bin_record_counter_tokens(tmp_path):
    # token field numbering records (one layer each) is regrouped by layer order
    recs = [(i, i % 3, [i % 5, (i + 2) % 5]) for i in range(6)]
    p = tmp_path / "c.trace"
    p.write_bytes(_nuth_bytes(3, 5, recs))
    tr = load_trace(p)
    assert tr.n_tokens == 2 and (tr.phase == DECODE).all()
    assert tr.experts[1].tolist() == [[3, 0], [4, 1], [0, 2]]


def test_nuthatch_bin_errors(tmp_path):
    p = tmp_path / "n.trace"
    recs = [(0, 0, [1, 2]), (0, 1, [3, 4])]
    p.write_bytes(_nuth_bytes(2, 6, recs, magic=b"NUTHTRC9"))
    with pytest.raises(MboltError, match=r"n\.trace: bad NUTHTRC1 magic"):
        load_trace(p, fmt="nuthatch-bin")
    data = _nuth_bytes(2, 6, recs)
    p.write_bytes(data[:-6])
    with pytest.raises(MboltError, match=r"n\.trace: record 1 at byte 48: truncated"):
        load_trace(p)
    p.write_bytes(_nuth_bytes(2, 6, recs, n_records=3))
    with pytest.raises(MboltError, match=r"record 2 at byte 68: truncated \(header says 3"):
        load_trace(p)
    p.write_bytes(_nuth_bytes(2, 6, [(0, 0, [1, 2]), (0, 1, [3, 6])]))
    with pytest.raises(MboltError, match=r"n\.trace: record 1 at byte 48: expert id 6 out of "
                                         r"range"):
        load_trace(p)
    p.write_bytes(_nuth_bytes(2, 2, [(0, 0, [0, 1, 0])]))
    with pytest.raises(MboltError, match=r"record 0 at byte 28: n_sel=3 is larger than the "
                                         r"number of experts \(2\)"):
        load_trace(p)


# ---- nuthatch text errors ----------------------------------------------------------------------


def test_nuthatch_text_errors(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("0 1 2\n1 3 x\n")
    with pytest.raises(MboltError, match=r"t\.txt: line 2: not integers"):
        load_trace(p, fmt="nuthatch-text")
    p.write_text("0 1 2\n1 3 9\n")
    with pytest.raises(MboltError, match=r"t\.txt: line 2: expert id 9 out of range"):
        load_trace(p, n_experts=8)
    p.write_text("0 1 2\n1 3 3\n")
    with pytest.raises(MboltError, match=r"t\.txt: line 2: an expert id is repeated"):
        load_trace(p)
    p.write_text("hello\n")
    with pytest.raises(MboltError, match="unknown trace format"):
        load_trace(p)


def test_k_equal_experts_is_never_flagged(tmp_path):
    # with k == E every row is a full ranking, and strided and contiguous reads coincide
    rng = np.random.default_rng(5)
    rows = [_rankings(rng, 3, 4) for _ in range(2)]
    p = tmp_path / "full.txt"
    p.write_text("\n".join(f"{layer} " + " ".join(map(str, r)) for layer in range(2)
                           for r in rows[layer]))
    tr = load_trace(p)
    assert tr.n_tokens == 3 and tr.notes == [] and tr.experts[2, 1].tolist() == rows[1][2].tolist()
