"""C sources -> a loaded library, with the system C compiler (the one place mbolt compiles C).

A library is compiled once into ``$XDG_CACHE_HOME/mbolt`` (else ``~/.cache/mbolt``); its file
name carries a hash of the sources, so an edited source is compiled again and an unchanged one is
only loaded. Without a compiler (or when it fails) `load_c_library` returns None and each caller
keeps its pure-Python path: the expert cache rule (core/lru.c, bound by core.lru) and the
runtime's eval-callback filter (runtime/native.c, runtime.native).

It lives in core, the foundation, because core.lru binds its C rule through it and core imports
nothing above it; runtime.native compiles its own library through it as well.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mbolt"


def load_c_library(name: str, sources: dict[str, str]) -> ctypes.CDLL | None:
    """`sources` (file name -> text; headers included, `*.c` compiled) built as one shared
    library `name`, loaded; None when no C compiler is at hand or the build fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tag = hashlib.sha256("".join(sources.values()).encode()).hexdigest()[:12]
    so = cache_dir() / f"{name}-{tag}.so"
    try:
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
                for file, text in sources.items():
                    (Path(tmp) / file).write_text(text)
                out = Path(tmp) / "f.so"
                subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(out),
                                *(str(Path(tmp) / f) for f in sources if f.endswith(".c"))], check=True,
                               capture_output=True, timeout=120)
                os.replace(out, so)  # complete or not at all; a concurrent build writes the same bytes
        return ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None
