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
