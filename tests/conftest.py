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


def require_vocab(path: Path) -> Path:
    """A test vocabulary of tests/.vocabs (scripts/fetch_test_vocabs.py fetches them from llama.cpp's
    release): where it is missing the test skips, and fails in CI."""
    if not path.exists():
        if IN_CI:
            pytest.fail("tests/.vocabs is missing in CI")
        pytest.skip("tests/.vocabs is missing: run scripts/fetch_test_vocabs.py")
    return path


# The synthetic models of tests that compare greedy predictions scale their experts' output by this
# (SynthConfig.expert_gain): at 1 the experts are ~5% of the logits and zeroing every expert leaves
# 88-97% of llama.cpp's predictions unchanged, so such a test cannot see a wrong expert byte; at 16
# most predictions change (test_synth_llama checks each of those models)
EXPERT_GAIN = 16.0


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real routing data and prompts shipped in the repository (mbolt/data/README.md)."""
    from mbolt.data import HERE

    return HERE
