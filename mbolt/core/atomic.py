"""Write outputs so that nothing is ever lost: temp file beside the target, fsync, rename.

`check_output` is the one rule every command applies to its output path before any work:
never one of the command's inputs, nor the file an input was made from (a rewritten GGUF's
source, a trace's model); an existing file only with --force, and then only a previous output
of the same kind (`file_kind`), so `--force` can never replace a downloaded model with a trace.
"""

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
    if path.is_dir():
        raise MboltError(f"{path}: is a directory, expected an output file path")
    if not path.parent.is_dir():
        raise MboltError(f"{path.parent}: output directory does not exist")
    clean_stale_parts(path)  # what a killed earlier writer of this output left behind
    # The pid in the name lets clean_stale_parts() tell a killed writer's leftover from a live one.
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".part", dir=path.parent)
    except OSError as e:
        raise MboltError(f"{path}: cannot create the output: {e.strerror}") from None
    # mkstemp creates 0600; give the output the permissions a plain open() would.
    os.fchmod(fd, 0o666 & ~_umask())
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, MboltError):
            # a write error (no space left, quota, I/O error) has no file name: name the output
            where = e.filename if e.filename and e.filename != tmp else path
            raise MboltError(f"{where}: {e.strerror or e} (nothing was written to {path})") from None
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
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def stored_path(path: str | os.PathLike, result_file: str | os.PathLike) -> str:
    """How a result file records a path: relative to the result file's folder, so the folder can
    be read from any directory (and moved whole)."""
    return os.path.relpath(Path(path).absolute(), Path(result_file).absolute().parent)


def resolve_stored_path(stored: str | os.PathLike, result_file: str | os.PathLike) -> Path:
    """The file a result file's recorded path names (relative to the result file; absolute as is)."""
    p = Path(stored)
    return p if p.is_absolute() else Path(result_file).parent / p


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a temporary file's writer, named in its name)."""
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


# ---- the output rule ----


def file_kind(path: str | os.PathLike) -> str:
    """What an existing file is, from its first bytes: a model GGUF, a GGUF mbolt wrote
    (route map or synthetic), an .mbtrace, a plan.json, other JSON, a PNG, text or other."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return "other"
    if head.startswith(b"GGUF"):
        # a shard of a set mbolt wrote carries mbolt.set.id (the route map is in shard 1 only)
        return "gguf-mbolt" if (b"mbolt.layout" in head or b"mbolt.synth" in head or b"mbolt.set.id" in head
                               or b"mbolt-kernel" in head) else "gguf-model"
    if head.startswith(b"MBTRACE"):
        return "mbtrace"
    if head.startswith(b"\x89PNG"):
        return "png"
    text = head.lstrip()
    if text.startswith(b"{") or text.startswith(b"["):
        plan = any(f'"format":{sp}"mbolt.{k}"'.encode() in head for sp in ("", " ") for k in ("plan", "perms"))
        return "plan" if plan else "json"
    if head.startswith(b"-1 ") or head.startswith(b"-2 "):  # colibri's .coli_usage header records
        return "coli-usage"
    try:
        head.decode("utf-8")
        return "text"
    except UnicodeDecodeError:
        return "other"


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(path: str | os.PathLike, *, kind: str | tuple[str, ...], inputs=(), force: bool = False,
                 protected_fingerprints=(), what: str = "output", make_parent: bool = False) -> Path:
    """Refuse an output path that would lose data; call before any work.

    `inputs`: the command's input paths (the output may be none of them). `protected_fingerprints`:
    header fingerprints of files the inputs were made from (a rewritten file's source, a trace's
    model): an existing GGUF with one of them is never replaced. `kind`: what the command
    writes; with `force` an existing file is replaced only if `file_kind` says it is that kind.
    `make_parent`: the writer creates missing parent directories (then the nearest existing
    ancestor must be a writable directory).
    """
    path = Path(path)
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    for inp in inputs:
        if inp is not None and _same(path, Path(inp)):
            raise MboltError(f"{path}: is an input of this command; write the {what} to a new path")
    if path.is_dir():
        raise MboltError(f"{path}: is a directory (give a file path for the {what})")
    parent = path.parent
    if make_parent:  # the writer creates missing directories: check the nearest existing one
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise MboltError(f"{parent}: is a file, not a directory (the {what} cannot go under it)")
    if not parent.is_dir():
        raise MboltError(f"{parent}: output directory does not exist")
    if not os.access(parent, os.W_OK):
        raise MboltError(f"{parent}: output directory is not writable")
    if path.exists() or path.is_symlink():
        found = file_kind(path)
        if found.startswith("gguf") and protected_fingerprints:
            from mbolt.core.header import read_header

            try:
                fp = read_header(path).fingerprint
            except MboltError:
                fp = ""
            if fp and fp in protected_fingerprints:
                raise MboltError(f"{path}: is the model an input was made from; refusing to replace it "
                                 f"(write the {what} to a new path)")
        if not force:
            raise MboltError(f"{path}: output exists (use --force to overwrite)")
        if found not in kinds:
            raise MboltError(f"{path}: exists and is not a previous {what} ({found.replace('-', ' ')}); "
                             "--force replaces only an earlier output of the same kind")
    return path
