"""Our strict GGUF header parser against gguf-py's reader (the reference) and on damaged files."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from mbolt.core.errors import MboltError
from mbolt.core.header import read_header


def write_sample(path):
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("a.u32", 7)
    w.add_int64("a.i64", -5)
    w.add_float32("a.f32", 0.25)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo")
    w.add_array("a.strs", ["x", "yy", "Ġz"])
    w.add_array("a.ints", [1, 2, 3])
    w.add_tensor("t.f32", np.arange(64, dtype=np.float32).reshape(2, 32))
    q = quantize(np.ones((4, 64), np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("t.q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_matches_gguf_py(tmp_path):
    p = tmp_path / "s.gguf"
    write_sample(p)
    h = read_header(p)
    r = GGUFReader(p)
    assert h.data_offset == r.data_offset
    assert [t.name for t in h.tensors] == [t.name for t in r.tensors]
    for mine, ref in zip(h.tensors, r.tensors):
        assert mine.data_offset == ref.data_offset
        assert mine.nbytes == ref.n_bytes
        assert list(mine.ne) == ref.shape.tolist()
        assert mine.type == ref.tensor_type
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = h.get(key)
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key


def test_damaged_files_name_the_problem(tmp_path):
    p = tmp_path / "s.gguf"
    write_sample(p)
    raw = p.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[:-40])  # past the trailing alignment padding
    with pytest.raises(MboltError, match=r"cut.gguf: tensor t.q8 ends past the end of the file"):
        read_header(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(raw[:100])
    with pytest.raises(MboltError, match=r"head.gguf: truncated GGUF header"):
        read_header(tmp_path / "head.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + raw[4:])
    with pytest.raises(MboltError, match="bad magic"):
        read_header(tmp_path / "bad.gguf")
    with pytest.raises(MboltError, match="no such file"):
        read_header(tmp_path / "missing.gguf")


def test_fingerprint_covers_header_not_data(tmp_path):
    p = tmp_path / "s.gguf"
    write_sample(p)
    fp = read_header(p).fingerprint
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF  # data byte
    (tmp_path / "d.gguf").write_bytes(raw)
    assert read_header(tmp_path / "d.gguf").fingerprint == fp
    raw = bytearray(p.read_bytes())
    raw[raw.index(b"a.u32") + 9] ^= 0x01  # the u32 value
    (tmp_path / "h.gguf").write_bytes(raw)
    assert read_header(tmp_path / "h.gguf").fingerprint != fp


def test_duplicate_keys_and_tensor_names_are_refused(tmp_path):
    """A key or tensor name twice: gguf-py refuses such a file too (which copy counts is undefined)."""
    p = tmp_path / "s.gguf"
    write_sample(p)
    raw = p.read_bytes()
    assert raw.count(b"a.f32") == 1
    (tmp_path / "dupkey.gguf").write_bytes(raw.replace(b"a.f32", b"a.u32"))
    with pytest.raises(MboltError, match="dupkey.gguf: metadata key a.u32 appears twice"):
        read_header(tmp_path / "dupkey.gguf")
    with pytest.raises((KeyError, ValueError)):
        GGUFReader(tmp_path / "dupkey.gguf")
    w = GGUFWriter(str(tmp_path / "two.gguf"), "qwen3moe")
    w.add_tensor("t.one", np.zeros((2, 32), np.float32))
    w.add_tensor("t.two", np.ones((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "duptensor.gguf").write_bytes((tmp_path / "two.gguf").read_bytes().replace(b"t.two", b"t.one"))
    with pytest.raises(MboltError, match="duptensor.gguf: tensor t.one appears twice"):
        read_header(tmp_path / "duptensor.gguf")
    with pytest.raises((KeyError, ValueError)):
        GGUFReader(tmp_path / "duptensor.gguf")
