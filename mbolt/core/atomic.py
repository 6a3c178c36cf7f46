"""Write outputs so that nothing is ever lost: temp file beside the target, fsync, rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from mbolt.core.errors import MboltError


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, force: bool = True, mode: str = "wb"):
    """Yield a file object whose contents appear at `path` only if the block completes.

    On any exception (including KeyboardInterrupt) the temporary file is removed and `path`
    is left as it was.
    """
    path = Path(path)
    if path.exists() and not force:
        raise MboltError(f"{path}: output exists (use --force to overwrite)")
    if not path.parent.exists():
        raise MboltError(f"{path.parent}: output directory does not exist")
    # The pid in the name lets clean_stale_parts() tell a killed writer's leftover from a live one.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".part", dir=path.parent)
    # mkstemp creates 0600; give the output the permissions a plain open() would.
    os.fchmod(fd, 0o666 & ~_umask())
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_output(path, mode="w") as f:
        f.write(text)


def clean_stale_parts(path: str | os.PathLike) -> list[Path]:
    """Remove temp files that a writer of `path` killed by SIGKILL (or a power cut) left behind.

    Only `.NAME.PID.*.part` files whose PID is no longer running are removed; returns them.
    """
    path = Path(path)
    removed = []
    for p in path.parent.glob(f".{glob_escape(path.name)}.*.part"):
        pid = p.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def json_default(o):
    """`json.dumps(default=...)` for what stages hand over: numpy scalars and arrays, paths."""
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")
