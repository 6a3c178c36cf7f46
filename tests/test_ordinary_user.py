"""The runtime as an ordinary user gets it (issue 33): a non-root uid, no CAP_IPC_LOCK,
RLIMIT_MEMLOCK of 8 MiB, its own cache directory for the C filter.

The suite runs as root in CI, and the interpreter lives where uid nobody cannot reach it
(/root/.pyenv), so `runuser -u nobody python ...` cannot start there. The test spawns a fresh
interpreter instead, which decodes once as root (every module and library it needs is loaded
then) and then gives up root for uid nobody
(setgroups, setgid, setuid: no capability left), lowers RLIMIT_MEMLOCK to 8 MiB as a login would,
compiles the C filter afresh into a cache directory of its own, and decodes a model that uid
nobody can read, whose dense weights (a real 152k-token
vocabulary) are larger than 8 MiB. Checked from outside the child: it ran as nobody, it could not
lock its dense weights and held them as anonymous copies instead, its filter answered cached
layers, and it decoded the tokens root decodes."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from conftest import needs_llama, require_vocab
from mbolt.synth.synth import SynthConfig, write_synth

VOCAB = Path(__file__).parent / ".vocabs" / "ggml-vocab-qwen2.gguf"
MEMLOCK = 8 << 20  # what an ordinary user's login gets (systemd's default)
pytestmark = [needs_llama,
              pytest.mark.skipif(os.geteuid() != 0, reason="the suite itself runs as an ordinary user here")]


def _decode(model: Path) -> dict:
    from mbolt.runtime.driver import open_driver

    ids = list(range(100, 160))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        d = open_driver(model, reads=True, qd=2, asynchronous=True, n_ctx=256, budget=2 << 30)
    with d:
        d.make_cold()
        runs = [d.generate([ids], 16, forced=16) for _ in range(2)]
        return {"uid": os.geteuid(), "tokens": [r.generated for r in runs], "misses": runs[0].misses,
                "hits": runs[1].hits, "locked": d.locked_bytes, "copied": d.copied_bytes,
                "native": d.runner.native_filter, "fast_layers": d.arm.fast_layers,
                "hidden": [str(w.message) for w in said if "hides its page-cache residency" in str(w.message)]}


def _nobody(model: str, cache: str, out) -> None:
    """In a fresh interpreter (spawned: no thread pool of the parent's llama.cpp inherited): one
    decode as root first, so that every module and library it loads is loaded (nobody cannot read
    the interpreter's site-packages under /root, which an installed package's user could), then
    give up root for uid nobody, lower RLIMIT_MEMLOCK as a login would, and `_decode` afresh."""
    try:
        from mbolt.bench.ab_llama import become_ordinary_user

        _decode(Path(model))
        become_ordinary_user(cache)  # what the benchmarks' user arm does: setuid nobody, 8 MiB, own cache
        out.put(_decode(Path(model)))
    except BaseException as e:  # the parent reports it
        out.put({"error": f"{type(e).__name__}: {e}"})


def _as_nobody(model: Path, cache: Path) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_nobody, args=(str(model), str(cache), q))
    p.start()
    try:
        return q.get(timeout=300)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()


def test_the_runtime_as_uid_nobody_decodes_what_root_decodes():
    require_vocab(VOCAB)
    base = Path(tempfile.mkdtemp(prefix="mbolt-user-", dir="/tmp"))  # pytest's tmp_path is root's alone (0700)
    try:
        base.chmod(0o755)
        model = base / "m.gguf"
        write_synth(model, SynthConfig(arch="qwen3moe", n_layers=3, n_experts=16, n_used=4, hidden=64, expert_ff=64,
                                       n_heads=4, n_kv_heads=2, head_dim=16, expert_type="Q8_0", dense_type="F16",
                                       vocab=str(VOCAB), seed=5))
        model.chmod(0o644)
        cache = base / "cache"
        cache.mkdir()
        nobody = pwd.getpwnam("nobody")
        os.chown(cache, nobody.pw_uid, nobody.pw_gid)
        root = _decode(model)
        user = _as_nobody(model, cache)
        assert "error" not in user, user["error"]
        assert root["uid"] == 0 and user["uid"] == nobody.pw_uid
        assert user["tokens"] == root["tokens"]
        # the model is root's: the kernel hides its residency from nobody (mincore would say every
        # page is resident), and the runtime says so once, naming the file
        assert not root["hidden"] and len(user["hidden"]) == 1 and str(model) in user["hidden"][0]
        assert user["misses"] > 0 and user["hits"] == 16 * 4 * 3  # it read experts, then found them cached
        # root locks every dense page; nobody cannot lock beyond 8 MiB and holds the rest as copies
        assert root["copied"] == 0 and root["locked"] > MEMLOCK
        assert user["locked"] <= MEMLOCK and user["copied"] > 0
        assert user["locked"] + user["copied"] == root["locked"]
        # the C filter built by nobody into its own cache, and it answered cached layers
        built = list((cache / "mbolt").glob("*.so"))
        assert user["native"] and user["fast_layers"] > 0 and built
        assert all(p.stat().st_uid == nobody.pw_uid for p in built)
    finally:
        shutil.rmtree(base, ignore_errors=True)
