"""Outputs appear whole or not at all."""

import os
import stat

import pytest

from mbolt.core.atomic import atomic_output
from mbolt.core.errors import MboltError


def test_interrupted_block_leaves_nothing(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(out) as f:
            f.write(b"partial")
            raise KeyboardInterrupt
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_without_force(tmp_path):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(MboltError, match="exists"):
        with atomic_output(out, force=False) as f:
            f.write(b"new")
    assert out.read_bytes() == b"old"


def test_output_gets_umask_permissions(tmp_path):
    out = tmp_path / "out.bin"
    old = os.umask(0o022)
    try:
        with atomic_output(out) as f:
            f.write(b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert out.read_bytes() == b"x"


# ---- check_output: the one output rule ----

from mbolt.core.atomic import check_output, clean_stale_parts, file_kind  # noqa: E402


@pytest.fixture
def files(tmp_path):
    from mbolt.core.mbtrace import write_trace
    from mbolt.core.trace import Trace
    from mbolt.synth.synth import SynthConfig, write_synth

    import numpy as np

    model = tmp_path / "model.gguf"
    write_synth(model, SynthConfig(n_layers=2, n_experts=4, n_used=2, hidden=32, expert_ff=32, fast_random=True,
                                   n_heads=2, n_kv_heads=2, head_dim=16))
    ex = np.array([[[0, 1], [2, 3]]] * 4, np.int16)
    trace = tmp_path / "t.mbtrace"
    write_trace(trace, Trace(2, 4, 2, ex, np.ones(4, np.uint8), np.zeros(4, np.int32), np.arange(4, dtype=np.int32)))
    (tmp_path / "notes.txt").write_text("mine\n")
    return {"model": model, "trace": trace, "text": tmp_path / "notes.txt"}


def test_file_kind_reads_the_first_bytes(files, tmp_path):
    assert file_kind(files["model"]) == "gguf-mbolt"  # synth marks its files
    assert file_kind(files["trace"]) == "mbtrace"
    assert file_kind(files["text"]) == "text"
    (tmp_path / "p.json").write_text('{"format": "mbolt.plan", "layers": []}')
    assert file_kind(tmp_path / "p.json") == "plan"
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00")
    assert file_kind(tmp_path / "b.bin") == "other"


def test_output_may_not_be_an_input_even_with_force(files):
    for inp in files.values():
        with pytest.raises(MboltError, match="is an input of this command"):
            check_output(inp, kind=("mbtrace", "plan", "text", "gguf-mbolt"), inputs=[inp], force=True)


def test_input_reached_through_a_symlink_is_still_an_input(files, tmp_path):
    link = tmp_path / "alias.mbtrace"
    link.symlink_to(files["trace"])
    with pytest.raises(MboltError, match="is an input"):
        check_output(link, kind="mbtrace", inputs=[files["trace"]], force=True)


def test_force_replaces_only_the_same_kind(files):
    with pytest.raises(MboltError, match="output exists"):
        check_output(files["trace"], kind="mbtrace")
    assert check_output(files["trace"], kind="mbtrace", force=True) == files["trace"]
    with pytest.raises(MboltError, match=r"not a previous trace \(text\)"):
        check_output(files["text"], kind="mbtrace", force=True, what="trace")


def test_protected_model_is_never_replaced(files):
    from mbolt.core.header import read_header

    fp = read_header(files["model"]).fingerprint
    with pytest.raises(MboltError, match="is the model an input was made from"):
        check_output(files["model"], kind="gguf-mbolt", force=True, protected_fingerprints=(fp,))
    # another fingerprint: an earlier output of the same kind may be replaced
    assert check_output(files["model"], kind="gguf-mbolt", force=True, protected_fingerprints=("0" * 32,))


def test_directories_and_missing_parents(files, tmp_path):
    with pytest.raises(MboltError, match="is a directory"):
        check_output(tmp_path, kind="json")
    with pytest.raises(MboltError, match="output directory does not exist"):
        check_output(tmp_path / "a" / "b.json", kind="json")
    # the writer creates missing directories: the nearest existing ancestor decides
    assert check_output(tmp_path / "a" / "b" / "c.json", kind="json", make_parent=True)
    with pytest.raises(MboltError, match="notes.txt: is a file, not a directory"):
        check_output(files["text"] / "c.json", kind="json", make_parent=True)
    assert not (tmp_path / "a").exists()  # checking creates nothing


def test_stale_part_of_a_killed_writer_is_cleaned_by_the_next_write(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "x.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".x.json.{dead}.abc.part"
    stale.write_text("torn")
    live = tmp_path / f".x.json.{os.getpid()}.abc.part"  # this process is alive: kept
    live.write_text("mine")
    with atomic_output(out, mode="w") as f:
        f.write("{}")
    assert not stale.exists() and live.exists() and out.read_text() == "{}"
    assert clean_stale_parts(out) == []
