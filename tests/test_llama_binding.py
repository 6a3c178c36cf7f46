"""The binding the runtime stands on (runtime.binding): its version, its parameter structs and
the ggml_tensor prefix mbolt reads, checked against libggml's own accessors."""

from __future__ import annotations

import ctypes

import pytest

from conftest import needs_llama
from mbolt.core.errors import MboltError

pytestmark = needs_llama


def test_unknown_parameter_field_is_refused():
    import llama_cpp

    from mbolt.runtime.binding import set_fields

    mp = llama_cpp.llama_model_default_params()
    set_fields(mp, vocab_only=True, n_gpu_layers=0)
    assert mp.n_gpu_layers == 0
    with pytest.raises(MboltError, match="has no field 'use_extra_buffers'"):
        set_fields(mp, use_extra_buffers=False)  # a misspelt field: ctypes would keep it as an attribute


def test_another_binding_version_is_refused(monkeypatch):
    import llama_cpp

    from mbolt.runtime import binding

    monkeypatch.setattr(llama_cpp, "__version__", "0.3.99")
    with pytest.raises(MboltError, match="llama-cpp-python 0.3.99 is installed.*==0.3.36"):
        binding.lib()


def _tensor_in_memory(name: bytes):
    """A ggml_tensor-sized buffer holding our prefix (ne 8 x 3 x 1 x 1): what libggml's accessors read."""
    from mbolt.runtime.binding import GgmlTensor

    buf = (ctypes.c_ubyte * 512)()
    t = GgmlTensor.from_buffer(buf)
    t.type, t.name, t.data = 26, name, ctypes.addressof(buf) + 400
    for i, x in enumerate((8, 3, 1, 1)):
        t.ne[i] = x
    return buf, t


def test_tensor_prefix_agrees_with_libggml(monkeypatch):
    from mbolt.runtime import binding

    monkeypatch.setattr(binding, "_LAYOUT_CHECKED", False)
    buf, t = _tensor_in_memory(b"ffn_moe_topk-3")
    binding.check_tensor_layout(ctypes.addressof(buf), t)  # the accessors read what we read
    assert binding._LAYOUT_CHECKED and binding._GGML is not None


def test_tensor_prefix_that_disagrees_is_an_error(monkeypatch):
    from mbolt.runtime import binding

    monkeypatch.setattr(binding, "_LAYOUT_CHECKED", False)
    buf, t = _tensor_in_memory(b"ffn_moe_topk-3")
    seen = binding.GgmlTensor.from_buffer_copy(buf)
    seen.ne[1] = 5  # what a binding with another layout would believe
    with pytest.raises(MboltError, match="ggml_tensor layout differs"):
        binding.check_tensor_layout(ctypes.addressof(buf), seen)
