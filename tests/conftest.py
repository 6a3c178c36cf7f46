"""Shared test helpers.

Tests that need llama.cpp use `needs_llama`: they run in CI (CI=true) and fail there if the
bindings are missing; locally they skip only when llama_cpp cannot be imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _llama_marker():
    if HAVE_LLAMA or IN_CI:
        return pytest.mark.llama
    return pytest.mark.skip(reason="llama_cpp not installed (required in CI)")


needs_llama = _llama_marker()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real routing data and prompts shipped in the repository (mbolt/data/README.md)."""
    from mbolt.data import HERE

    return HERE
