"""Writing an output (one file or a set of shards) so that it appears complete or not at all: a lock
per output, a journal of the shards being written, recovery of an interrupted set, and the check
that no output is an input or a file an input was made from."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mbolt.core.atomic import check_output
from mbolt.core.errors import MboltError
from mbolt.core.gguf_set import SET_ID_KEY, open_model_header

# ---- writing a set atomically ----

LOCK_SUFFIX = ".lock"
JOURNAL_SUFFIX = ".journal"


@contextlib.contextmanager
def output_lock(dst: Path):
    """Serialise writers of one output: an flock on `.NAME.lock` beside it; a second writer
    is refused (never waits, never interleaves). The lock file is removed on release."""
    import fcntl

    lock = dst.with_name(f".{dst.name}{LOCK_SUFFIX}")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise MboltError(f"{lock}: cannot create the output lock: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise MboltError(f"{dst}: another mbolt reorder is writing this output (lock {lock.name}); "
                             "wait for it or write to another path") from None
        try:  # the holder before us may have removed the file after we opened it: retry on the new one
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def recover_interrupted(dst: Path) -> list[Path]:
    """Remove what a writer of `dst` killed during its final renames left: it journals the set
    it is renaming into place; shards of that set found here (which readers refuse beside the
    old ones, their set ids differ) are removed with the shards they were replacing.
    Call with the output lock held. Returns what was removed."""
    import json

    removed = []
    for j in dst.parent.glob(f".{set_glob(dst.name)}.*{JOURNAL_SUFFIX}"):
        try:
            d = json.loads(j.read_text())
            paths, set_id = [Path(p) for p in d["paths"]], d["set_id"]
        except (OSError, ValueError, KeyError, TypeError):
            paths, set_id = [], None
        started = False
        for p in paths:
            with contextlib.suppress(MboltError, OSError):
                from mbolt.core.header import read_header

                started |= bool(set_id) and read_header(p).get(SET_ID_KEY) == set_id
        if started:
            for p in paths + [Path(x) for x in d.get("sidecar", [])]:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
        with contextlib.suppress(FileNotFoundError):
            j.unlink()
            removed.append(j)
    return removed


def set_glob(name: str) -> str:
    import glob

    return glob.escape(name)


def fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_outputs(paths: list[Path], side: Path | None, inputs: list, force: bool, protected: set[str]) -> None:
    """core.atomic.check_output for every output file, plus: an existing shard of the set an
    input was made from is never replaced (its set fingerprint is protected)."""
    for p in paths:
        check_output(p, kind="gguf-mbolt", inputs=inputs, force=force, protected_fingerprints=protected,
                     what="rewritten model")
        if p.exists() and protected:
            try:
                fp = open_model_header(p).fingerprint
            except MboltError:
                fp = ""  # not a readable model or set: check_output decided
            if fp in protected:
                raise MboltError(f"{p}: is part of the model an input was made from; refusing to replace it "
                                 "(write the rewritten model to a new path)")
    if side is not None and side.exists():
        check_output(side, kind="json", inputs=inputs, force=True, what="route-map sidecar")
