"""The .mbtrace format: round trip, append-only writer, crash truncation, broken files."""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mbolt.core.errors import MboltError
from mbolt.core.mbtrace import TraceWriter, read_trace, write_trace
from mbolt.core.trace import DECODE, PREFILL, Trace


def _random_trace(rng: np.random.Generator, n: int, n_layers: int, n_experts: int, k: int,
                  weights: bool, n_domains: int = 0, dense: int = 0) -> Trace:
    experts = np.argsort(rng.random((n, n_layers, n_experts)), axis=-1)[..., :k].astype(np.int16)
    experts[:, :dense] = -1
    seq = np.sort(rng.integers(0, 3, n)).astype(np.int32)
    return Trace(
        n_layers, n_experts, k, experts,
        rng.integers(0, 2, n).astype(np.uint8), seq, np.arange(n, dtype=np.int32),
        rng.random((n, n_layers, k)).astype(np.float32) if weights else None,
        {int(s): f"dom-{s}-é" for s in range(n_domains)}, "ab12" if n % 2 else "", ["a note"] * (n % 3),
    )


def _assert_same(a: Trace, b: Trace) -> None:
    assert (a.n_layers, a.n_experts, a.k) == (b.n_layers, b.n_experts, b.k)
    assert a.experts.dtype == np.int16 and a.experts.shape == b.experts.shape
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.phase, b.phase)
    np.testing.assert_array_equal(a.seq, b.seq)
    np.testing.assert_array_equal(a.pos, b.pos)
    if b.weights is None:
        assert a.weights is None
    else:
        np.testing.assert_array_equal(a.weights, b.weights)
    assert a.domains == b.domains and a.fingerprint == b.fingerprint and a.notes == b.notes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 40), n_layers=st.integers(1, 6), n_experts=st.integers(1, 40),
    kfrac=st.floats(0, 1), weights=st.booleans(), n_domains=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_round_trip_random(tmp_path, n, n_layers, n_experts, kfrac, weights, n_domains, seed):
    k = 1 + int(kfrac * (n_experts - 1))
    rng = np.random.default_rng(seed)
    tr = _random_trace(rng, n, n_layers, n_experts, k, weights, n_domains, dense=int(n_layers > 2))
    p = tmp_path / "r.mbtrace"
    write_trace(p, tr)
    _assert_same(read_trace(p), tr)
    # the streaming writer produces a file that reads back identically
    q = tmp_path / "s.mbtrace"
    with TraceWriter(q, n_layers, n_experts, k, tr.fingerprint, weights=weights) as w:
        for note in tr.notes:
            w.add_note(note)
        for s, tag in tr.domains.items():
            w.set_domain(s, tag)
        for i in range(n):
            w.append("prefill" if tr.phase[i] == PREFILL else "decode", int(tr.seq[i]),
                     int(tr.pos[i]), tr.experts[i], None if tr.weights is None else tr.weights[i])
    _assert_same(read_trace(q), tr)


def test_writer_file_is_readable_while_open(tmp_path):
    p = tmp_path / "live.mbtrace"
    w = TraceWriter(p, 2, 8, 2)
    w.append("decode", 0, 0, [[1, 2], [3, 4]])
    w.set_domain(0, "code")
    w.append(DECODE, 0, 1, [[5, 6], [-1, -1]])
    live = read_trace(p)  # nothing closed yet: both records already on disk
    assert live.n_tokens == 2 and live.domains == {0: "code"}
    assert live.experts[1].tolist() == [[5, 6], [-1, -1]]
    w.extend("prefill", [1, 1], [0, 1], np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]))
    w.close()
    t = read_trace(p)
    assert t.n_tokens == 4 and t.phase.tolist() == [1, 1, 0, 0] and t.seq.tolist() == [0, 0, 1, 1]


def _write_small(tmp_path, n=5, weights=False):
    rng = np.random.default_rng(1)
    tr = _random_trace(rng, n, 3, 16, 4, weights)
    tr.notes = []
    p = tmp_path / "t.mbtrace"
    with TraceWriter(p, 3, 16, 4, weights=weights) as w:
        for i in range(n):
            w.append(int(tr.phase[i]), int(tr.seq[i]), int(tr.pos[i]), tr.experts[i],
                     None if tr.weights is None else tr.weights[i])
    return p, tr


@pytest.mark.parametrize("weights", [False, True])
def test_truncation_at_every_byte_of_last_record(tmp_path, weights):
    p, tr = _write_small(tmp_path, weights=weights)
    data = p.read_bytes()
    rec = 1 + 4 + 9 + 3 * 4 * (2 + (4 if weights else 0)) + 4  # tag, len, fixed, ids, w, crc
    last = len(data) - rec
    cut = tmp_path / "cut.mbtrace"
    for n in range(last + 1, len(data)):
        cut.write_bytes(data[:n])
        with pytest.warns(UserWarning, match="torn last record"):
            t = read_trace(cut)
        assert t.n_tokens == 4
        np.testing.assert_array_equal(t.experts, tr.experts[:4])
        assert len(t.notes) == 1 and "record 4" in t.notes[0] and f"byte {last}" in t.notes[0]
    cut.write_bytes(data[:last])  # cut exactly at a record boundary: nothing lost, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_trace(cut).n_tokens == 4


def test_torn_last_record_with_bad_checksum_or_zero_tail(tmp_path):
    p, tr = _write_small(tmp_path)
    data = bytearray(p.read_bytes())
    data[-6] ^= 0xFF  # corrupt the last record's payload: its checksum fails
    p.write_bytes(bytes(data))
    with pytest.warns(UserWarning):
        assert read_trace(p).n_tokens == 4
    p.write_bytes(bytes(data[:-3]) + bytes(300))  # filesystem zero-fill after a crash
    with pytest.warns(UserWarning, match="torn last record"):
        assert read_trace(p).n_tokens == 4
    p.write_bytes(bytes(data[:-50]) + bytes(300))  # cut inside record 3 (of 42 bytes), zeros
    with pytest.warns(UserWarning, match="torn last record"):
        assert read_trace(p).n_tokens == 3


def test_corrupt_middle_record_is_an_error(tmp_path):
    p, _ = _write_small(tmp_path)
    data = bytearray(p.read_bytes())
    data[-60] ^= 0x01  # inside record 3 of 5
    p.write_bytes(bytes(data))
    with pytest.raises(MboltError, match=r"t\.mbtrace: record 3 at byte \d+: checksum mismatch"):
        read_trace(p)


def test_bad_magic_and_version(tmp_path):
    p, _ = _write_small(tmp_path)
    data = p.read_bytes()
    bad = tmp_path / "bad.mbtrace"
    bad.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(MboltError, match="bad.mbtrace: not an .mbtrace file"):
        read_trace(bad)
    bad.write_bytes(data[:8] + struct.pack("<I", 7) + data[12:])
    with pytest.raises(MboltError, match="bad.mbtrace: unsupported .mbtrace version 7"):
        read_trace(bad)
    bad.write_bytes(b"")
    with pytest.raises(MboltError, match="bad magic"):
        read_trace(bad)
    with pytest.raises(MboltError, match="not found"):
        read_trace(tmp_path / "missing.mbtrace")


def _rebuild_header(n_layers, n_experts, k) -> bytes:
    body = b"MBTRACE\0" + struct.pack("<IIIIIH", 1, n_layers, n_experts, k, 0, 0)
    return body + struct.pack("<I", zlib.crc32(body))


def _token_record(phase, seq, pos, ids) -> bytes:
    payload = struct.pack("<Bii", phase, seq, pos) + np.asarray(ids, "<i2").tobytes()
    head = b"T" + struct.pack("<I", len(payload))
    return head + payload + struct.pack("<I", zlib.crc32(head + payload))


def test_hand_built_file_reads(tmp_path):
    # independent of the writer: bytes laid out exactly as the module docstring says
    p = tmp_path / "hand.mbtrace"
    p.write_bytes(_rebuild_header(2, 4, 2) + _token_record(0, 7, 3, [0, 1, 2, 3])
                  + _token_record(1, 7, 4, [3, 2, -1, -1]))
    t = read_trace(p)
    assert t.experts.tolist() == [[[0, 1], [2, 3]], [[3, 2], [-1, -1]]]
    assert t.phase.tolist() == [PREFILL, DECODE] and t.seq.tolist() == [7, 7]
    assert t.pos.tolist() == [3, 4] and t.weights is None and t.fingerprint == ""


def test_expert_out_of_range_names_token_and_byte(tmp_path):
    p = tmp_path / "oor.mbtrace"
    head = _rebuild_header(2, 4, 2)
    r0 = _token_record(1, 0, 0, [0, 1, 2, 3])
    p.write_bytes(head + r0 + _token_record(1, 0, 1, [0, 1, 2, 9]))
    with pytest.raises(MboltError, match=rf"oor.mbtrace: token 1 at byte {len(head) + len(r0)}: "
                                         r"expert id 9 at layer 1 is out of range"):
        read_trace(p)
    with pytest.raises(MboltError, match="repeated in one layer at layer 0"):
        with TraceWriter(tmp_path / "dup.mbtrace", 2, 4, 2) as w:
            w.append("decode", 0, 0, [[0, 0], [2, 3]])


def test_k_larger_than_experts(tmp_path):
    p = tmp_path / "k.mbtrace"
    p.write_bytes(_rebuild_header(2, 4, 5))
    with pytest.raises(MboltError, match="k.mbtrace: header: k=5 is larger than the number of "
                                         "experts"):
        read_trace(p)
    with pytest.raises(MboltError, match="k=9 is larger"):
        TraceWriter(tmp_path / "w.mbtrace", 2, 8, 9)


def test_writer_rejects_bad_input(tmp_path):
    with TraceWriter(tmp_path / "w.mbtrace", 2, 8, 2) as w:
        with pytest.raises(MboltError, match="expert id 8 at layer 1 is out of range"):
            w.append("decode", 0, 0, [[0, 1], [2, 8]])
        with pytest.raises(MboltError, match=r"shape \[n, 2, 2\]"):
            w.append("decode", 0, 0, [[0, 1, 2], [2, 3, 4]])
        with pytest.raises(MboltError, match="phase"):
            w.append("warmup", 0, 0, [[0, 1], [2, 3]])
        with pytest.raises(MboltError, match="weights given"):
            w.append("decode", 0, 0, [[0, 1], [2, 3]], [[1, 1], [1, 1]])
    assert read_trace(tmp_path / "w.mbtrace").n_tokens == 0


def test_large_trace_round_trip(tmp_path):
    # 100k tokens x 48 layers x k=8 (77 MB): the vectorised reader keeps every record (its speed
    # is a benchmark's business, not a test's)
    n, L, E, k = 100_000, 48, 128, 8
    rng = np.random.default_rng(0)
    rows = np.argsort(rng.random((512, E)), axis=1)[:, :k].astype(np.int16)
    ex = rows[rng.integers(0, 512, (n, L))]
    tr = Trace(L, E, k, ex, np.ones(n, np.uint8), np.zeros(n, np.int32),
               np.arange(n, dtype=np.int32))
    p = tmp_path / "big.mbtrace"
    write_trace(p, tr)
    back = read_trace(p)
    assert back.n_tokens == n and np.array_equal(back.experts[-1], ex[-1])


def test_torn_domain_record(tmp_path):
    p = tmp_path / "d.mbtrace"
    with TraceWriter(p, 1, 4, 2) as w:
        w.set_domain(0, "code")
        w.append("decode", 0, 0, [[0, 1]])
        w.set_domain(1, "prose")
    data = p.read_bytes()
    p.write_bytes(data[:-3])
    with pytest.warns(UserWarning, match="cut short"):
        t = read_trace(p)
    assert t.n_tokens == 1 and t.domains == {0: "code"}
    p.write_bytes(data[:-3] + b"\x07" * 40)  # garbage after a torn record is corruption
    with pytest.raises(MboltError, match=r"d\.mbtrace: record 2 at byte \d+: checksum mismatch"):
        read_trace(p)


def test_writer_names_the_file_when_the_disk_is_full(tmp_path):
    """/dev/full fails every write with ENOSPC: the error names the trace, not a bare OSError."""
    import os

    from mbolt.core.mbtrace import TraceWriter

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(MboltError, match="/dev/full: cannot write the trace: No space left on device"):
        with TraceWriter("/dev/full", 2, 4, 2) as w:
            w.extend(1, 0, np.arange(4), np.zeros((4, 2, 2), np.int16) + np.array([0, 1]))
