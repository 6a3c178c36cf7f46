"""The llama.cpp the parity tests run against is the build README's command asks for.

pip reuses a cached llama-cpp-python wheel and then ignores CMAKE_ARGS, so a test could run
against a native build (AVX-512 kernels on a machine that has them) while README says
GGML_NATIVE=OFF. On x86-64 that build compiles ggml's CPU kernels up to AVX2 and no further,
whatever CPU builds it; its system info says so.
"""

from __future__ import annotations

import platform

import pytest

from conftest import needs_llama

pytestmark = needs_llama


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86-64 build flags")
def test_llama_cpp_is_the_portable_build():
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info, info
    assert "AVX512" not in info, (
        "llama-cpp-python was built with native CPU flags (a cached wheel?): reinstall it with README's "
        f"test command (CMAKE_ARGS=-DGGML_NATIVE=OFF, --no-binary, --no-cache-dir). System info: {info}")
