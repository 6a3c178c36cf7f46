"""Nothing lost: a reorder killed mid-write leaves no output (or the old one) and the input intact."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap

import pytest

from mbolt.synth.synth import SynthConfig, write_synth
from mbolt.rewrite.reorder import reorder

# Stop the copy after its third range, say so, and wait there (on stdin, which the parent never
# writes): the signal always lands mid-write, with no race against a timer.
# SIGINT's default handler is set explicitly: a shell without job control starts background
# commands with SIGINT ignored, and a child inherits that (a suite run with `&` saw the child
# ignore the SIGINT case and hang)
CHILD = textwrap.dedent("""
    import signal
    import sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    import mbolt.rewrite.copy as C
    import mbolt.rewrite.reorder as R
    orig = C.Copier.copy
    n = [0]
    def held(self, s, d, k):
        orig(self, s, d, k)
        n[0] += 1
        if n[0] == 3:
            print("COPYING", flush=True)
            sys.stdin.readline()
    C.Copier.copy = held
    rng = np.random.default_rng(0)
    perm = np.stack([rng.permutation(8) for _ in range(3)])
    R.reorder(sys.argv[1], sys.argv[2], perm, force=True)
    print("DONE", flush=True)
""")


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("kill") / "m.gguf"
    write_synth(p, SynthConfig(arch="mixtral", n_layers=3, n_experts=8, n_used=2, expert_type="Q8_0", seed=1))
    return p


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_kill_mid_write(model, tmp_path, sig):
    out = tmp_path / "out.gguf"
    reorder(model, out, None)  # --force run: the previous output must survive a killed rewrite
    previous = sha(out)
    before = sha(model)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(out)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "COPYING", child.stderr.read()
        parts = list(tmp_path.glob(".out.gguf.*.part"))
        assert len(parts) == 1  # the temp file beside the output is being written
        child.send_signal(sig)
        child.wait(timeout=30)  # stdin stays open: the child cannot go on unless the signal failed
        rest = child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "DONE" not in rest
    assert child.returncode != 0
    assert sha(out) == previous
    assert sha(model) == before
    leftovers = list(tmp_path.glob(".out.gguf.*.part"))
    if sig == signal.SIGKILL:
        # no handler runs on SIGKILL: the temp file stays, the next run removes it
        assert len(leftovers) == 1
        res = reorder(model, out, None, force=True)
        assert [str(p) for p in leftovers] == res.removed_stale
        assert not list(tmp_path.glob(".out.gguf.*.part"))
        assert out.stat().st_size > 1000
    else:
        assert leftovers == []


def test_stale_part_of_live_writer_is_kept(model, tmp_path):
    import os

    live = tmp_path / f".out.gguf.{os.getpid()}.abcd.part"
    live.write_bytes(b"x")
    dead = tmp_path / ".out.gguf.999999999.abcd.part"
    dead.write_bytes(b"x")
    res = reorder(model, tmp_path / "out.gguf", None)
    assert live.exists() and not dead.exists()
    assert res.removed_stale == [str(dead)]
    assert res.identity
