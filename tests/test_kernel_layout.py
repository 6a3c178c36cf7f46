"""The kernel layout (`mbolt repack`, issue 54): weights stored as llama.cpp's CPU backend repacks them.

Checked against llama.cpp itself: after its own default load of the stock file, every weight's bytes
in its buffers (found through a graph's nodes) are what core.repack predicts, repacked or not; a
kernel-layout file loaded into its buffers with no repacking gives the same logits, bit for bit.
The round trip is checked against the source file's own SHA-256 (hashlib), and stock llama.cpp
refuses the file.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from conftest import needs_llama
from mbolt.core.errors import MboltError
from mbolt.core.header import read_header
from mbolt.core.kernel_file import check_build, read_kernel
from mbolt.core.repack import LAYOUTS, build_named, build_of, layout_of, repack, unrepack
from mbolt.synth.config import SynthConfig
from mbolt.synth.synth import write_synth
from mbolt.rewrite.kernel import restore_stock, verify_kernel, write_kernel

AVX2 = build_named("avx2")
# small files of each repacked type (rows in groups of 8; hidden 256 for the K-quants' 256 blocks)
SHAPES = dict(n_layers=2, n_experts=8, n_used=2, hidden=256, expert_ff=256, n_heads=4, n_kv_heads=2, head_dim=64)
FILES = {
    "q4_k_m": SynthConfig(expert_type="Q4_K_M", dense_type="Q4_K_M", fast_random=True, **SHAPES),
    "q4_0": SynthConfig(expert_type="Q4_0", **SHAPES),
    "iq4_nl": SynthConfig(expert_type="IQ4_NL", fast_random=True, **SHAPES),
    "mxfp4": SynthConfig(arch="gpt-oss", expert_type="MXFP4", **SHAPES),
    "q2_k": SynthConfig(expert_type="Q2_K", fast_random=True, **SHAPES),  # repacked by AVX-512 builds only
}


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernel")
    return {name: write_synth(d / f"{name}.gguf", cfg) for name, cfg in FILES.items()}


# ---- the transforms ----


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_round_trips_any_bytes(name):
    r = LAYOUTS[name]
    block_elems, block_bytes = GGML_QUANT_SIZES[r.type]
    row = 3 * block_elems  # rows of 3 blocks, 16 rows: two groups of 8
    data = np.random.default_rng(1).integers(0, 256, 16 * 3 * block_bytes, dtype=np.uint8)
    out = repack(data, r, row)
    assert out.size == data.size and not np.array_equal(out, data)
    assert np.array_equal(unrepack(out, r, row), data)


def test_q4_0_flips_each_nibbles_top_bit_and_interleaves_8_bytes():
    # two rows of the same group: row r's first 8 quant bytes land in chunk r, XOR 0x88 (repack.cpp)
    r = LAYOUTS["q4_0_8x8"]
    blocks = np.zeros((8, 18), np.uint8)
    blocks[:, 0:2] = np.arange(8)[:, None]  # d of row r = r
    blocks[:, 2:18] = np.arange(16, dtype=np.uint8)[None, :] + 16 * np.arange(8, dtype=np.uint8)[:, None]
    out = repack(blocks.reshape(-1), r, 32)
    assert list(out[:16]) == [v for i in range(8) for v in (i, i)]
    qs = out[16:].reshape(16, 8)
    assert list(qs[3]) == [b ^ 0x88 for b in blocks[3, 2:10]]  # chunk 3: row 3, bytes 0-7
    assert list(qs[8 + 5]) == [b ^ 0x88 for b in blocks[5, 10:18]]  # chunk 13: row 5, bytes 8-15


def test_the_choice_follows_the_build():
    avx512 = build_named("avx512")
    assert layout_of("blk.0.ffn_gate_exps.weight", (256, 64, 8), Q.Q2_K, AVX2) is None
    assert layout_of("blk.0.ffn_gate_exps.weight", (256, 64, 8), Q.Q2_K, avx512).name == "q2_K_8x8"
    assert layout_of("blk.0.ffn_down_exps.weight", (256, 64, 8), Q.Q6_K, avx512) is None  # no x86 kernel
    assert layout_of("token_embd.weight", (256, 64), Q.Q4_K, AVX2) is None  # GET_ROWS, not a matmul
    assert layout_of("blk.0.attn_q.weight", (256, 60), Q.Q4_K, AVX2) is None  # 60 rows: not groups of 8
    assert build_of("CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | REPACK = 1 |").features >= {"AVX2"}
    assert not build_of("CPU : AVX2 = 1 | REPACK = 0 |").features  # built without repacking


# ---- against llama.cpp's own buffers ----


def _weights_in_llama(path) -> dict[str, bytes]:
    """Every weight's bytes as llama.cpp holds them after its default load (repacking on)."""
    from mbolt.runtime.binding import GgmlTensor, lib

    L = lib()
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    sizes = {t.name: t.nbytes for t in read_header(path).tensors}
    got: dict[str, bytes] = {}

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
    def look(t, ask, user):
        if ask:
            for s in GgmlTensor.from_address(t).src:
                g = GgmlTensor.from_address(s) if s else None
                if g is not None and g.name.decode() in sizes and not g.view_src:
                    got[g.name.decode()] = ctypes.string_at(g.data, sizes[g.name.decode()])
        return not ask

    cp = L.llama_context_default_params()
    cp.n_ctx, cp.cb_eval = 64, look
    ctx = L.llama_init_from_model(model, cp)
    tok = (ctypes.c_int32 * 1)(1)
    assert L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) == 0
    L.llama_free(ctx)
    L.llama_model_free(model)
    return got


def _this_build():
    from mbolt.core.repack import this_build

    return this_build()


@needs_llama
@pytest.mark.parametrize("name", sorted(FILES))
def test_llama_cpp_holds_exactly_what_repack_predicts(files, name):
    path = files[name]
    build = _this_build()
    held = _weights_in_llama(path)
    h = read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    repacked = 0
    for t in h.tensors:
        assert t.name in held, t.name
        src = np.asarray(raw[t.data_offset:t.data_offset + t.nbytes])
        lay = layout_of(t.name, t.ne, t.type, build)
        want = repack(src, lay, t.ne[0]) if lay else src
        assert np.frombuffer(held[t.name], np.uint8).tobytes() == want.tobytes(), (t.name, lay)
        repacked += lay is not None
    if name != "q2_k" or "AVX512" in build.features:
        assert repacked >= 4  # every expert matrix of the type under test at least


# ---- the file ----


def test_write_restore_and_verify_give_the_source_back_bit_for_bit(files, tmp_path):
    for name, path in files.items():
        kl = tmp_path / f"{name}.kl.gguf"
        r = write_kernel(path, kl, build_named("avx512") if name == "q2_k" else AVX2)
        assert sum(r.repacked.values()) >= 4 and r.sha256 == _sha(path)
        k = read_kernel(kl)
        assert k.architecture == read_header(path).get("general.architecture")
        assert all(t.data_offset % 4096 == 0 for t in k.header.tensors)  # O_DIRECT-aligned starts
        v = verify_kernel(path, kl)
        assert v["identical"] and v["sha256_ok"], v
        back = tmp_path / f"{name}.back.gguf"
        restore_stock(kl, back)
        assert _sha(back) == _sha(path)


def test_the_kernel_file_stores_the_repacked_bytes(files, tmp_path):
    path = files["q4_k_m"]
    kl = tmp_path / "k.gguf"
    write_kernel(path, kl, AVX2)
    src, out = read_header(path), read_header(kl)
    t = src.tensor("blk.0.ffn_gate_exps.weight")
    o = out.tensor(t.name)
    raw, kraw = open(path, "rb").read(), open(kl, "rb").read()
    stored = np.frombuffer(kraw[o.data_offset:o.data_offset + o.nbytes], np.uint8)
    stock = np.frombuffer(raw[t.data_offset:t.data_offset + t.nbytes], np.uint8)
    assert not np.array_equal(stored, stock)
    assert np.array_equal(unrepack(stored, LAYOUTS["q4_K_8x8"], t.ne[0]), stock)
    q6 = src.tensor("blk.1.ffn_down_exps.weight")  # Q6_K in this mix: no x86 kernel, kept as is
    assert q6.type == Q.Q6_K
    o6 = out.tensor(q6.name)
    assert kraw[o6.data_offset:o6.data_offset + o6.nbytes] == raw[q6.data_offset:q6.data_offset + q6.nbytes]


@needs_llama
def test_stock_llama_cpp_refuses_a_kernel_file(files, tmp_path):
    from mbolt.runtime.binding import lib, quiet

    kl = tmp_path / "k.gguf"
    write_kernel(files["q4_0"], kl, AVX2)
    L = lib()
    quiet(L)
    assert not L.llama_model_load_from_file(str(kl).encode(), L.llama_model_default_params())


def test_a_damaged_kernel_file_is_never_restored(files, tmp_path):
    kl = tmp_path / "k.gguf"
    write_kernel(files["q4_0"], kl, AVX2)
    b = bytearray(kl.read_bytes())
    b[-200] ^= 1  # a byte of the last tensor's data
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(b))
    v = verify_kernel(files["q4_0"], bad)
    assert not v["identical"] and not v["sha256_ok"] and v["first_difference"] is not None
    with pytest.raises(MboltError, match="SHA-256"):
        restore_stock(bad, tmp_path / "back.gguf")
    assert not (tmp_path / "back.gguf").exists()
    with pytest.raises(MboltError, match="was not made from"):
        verify_kernel(files["mxfp4"], kl)


def test_a_file_made_for_another_build_is_refused_in_one_line(tmp_path):
    q2 = write_synth(tmp_path / "q2.gguf", SynthConfig(expert_type="Q2_K", fast_random=True, **SHAPES))
    kl = tmp_path / "q2.kl.gguf"
    write_kernel(q2, kl, build_named("avx512"))  # Q2_K repacked: AVX-512 builds only
    k = read_kernel(kl)
    check_build(k, build_named("avx512"))
    with pytest.raises(MboltError) as e:
        check_build(k, AVX2)
    msg = str(e.value)
    assert "\n" not in msg and "AVX-512" in msg and "AVX2" in msg and "q2_K_8x8" in msg
    # the other way round: made where Q2_K stays as it is, opened where it would be repacked
    kl2 = tmp_path / "q2.avx2.gguf"
    write_kernel(q2, kl2, AVX2)
    with pytest.raises(MboltError, match="made for llama.cpp CPU, x86 AVX2"):
        check_build(read_kernel(kl2), build_named("avx512"))


def _mbolt(*args):
    return subprocess.run([sys.executable, "-m", "mbolt", *map(str, args)], capture_output=True, text=True)


def test_the_command(files, tmp_path):
    src, kl, back = files["iq4_nl"], tmp_path / "m.kl.gguf", tmp_path / "m.back.gguf"
    r = _mbolt("repack", src, kl, "--isa", "avx2", "--json")
    assert r.returncode == 0, r.stderr
    assert '"iq4_nl_8x8": 6' in r.stdout
    assert _mbolt("repack", src, kl, "--isa", "avx2").returncode == 2  # exists: --force
    r = _mbolt("verify", src, kl)
    assert r.returncode == 0 and "bit for bit" in r.stdout, r.stdout + r.stderr
    r = _mbolt("repack", "--restore", kl, back)
    assert r.returncode == 0 and _sha(back) == _sha(src)
    r = _mbolt("repack", "--restore", kl, back)  # never over an existing file
    assert r.returncode == 2 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _mbolt("repack", kl, tmp_path / "again.gguf", "--isa", "avx2")
    assert r.returncode == 2 and "already a kernel-layout file" in r.stderr
    r = _mbolt("repack", src, src, "--isa", "avx2")
    assert r.returncode == 2 and "input" in r.stderr


# ---- into llama.cpp with no repacking ----


@needs_llama
def test_a_kernel_file_in_llama_cpp_gives_its_own_repacked_logits_bit_for_bit(tmp_path):
    from mbolt.runtime.binding import lib
    from mbolt.runtime.kernel_load import load_kernel_model

    # experts big enough that the load's drops are seen (8 MiB of repacked experts per tensor)
    cfg = SynthConfig(n_layers=2, n_experts=32, n_used=4, hidden=1024, expert_ff=512, n_heads=8, n_kv_heads=2,
                      head_dim=128, expert_type="Q4_K_M", dense_type="Q4_K_M", fast_random=True, expert_gain=16.0)
    stock = write_synth(tmp_path / "m.gguf", cfg)
    kl = tmp_path / "m.kl.gguf"
    write_kernel(stock, kl, _this_build())
    ids = [3 + (7 * i) % 200 for i in range(24)]

    def logits(model) -> np.ndarray:
        L = lib()
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 64, 16, 16
        ctx = L.llama_init_from_model(model, cp)
        nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        out = []
        for chunk in (ids[:16], *([t] for t in ids[16:])):
            a = (ctypes.c_int32 * len(chunk))(*chunk)
            assert L.llama_decode(ctx, L.llama_batch_get_one(a, len(chunk))) == 0
            out.append(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(nv,)).copy())
        L.llama_free(ctx)
        return np.stack(out)

    L = lib()
    model = L.llama_model_load_from_file(str(stock).encode(), L.llama_model_default_params())
    want = logits(model)
    L.llama_model_free(model)

    km = load_kernel_model(kl)
    try:
        weights = sum(p.nbytes for p in km.places.values())
        assert km.timings["buffers_dropped"] > 0.7 * weights  # the repack buffer at least, dropped while loading
        assert _resident(km.places.values()) < 0.02 * weights  # nothing of them held after the load (mincore)
        km.fill_all()
        assert _resident(km.places.values()) > 0.98 * weights
        got = logits(km.model)
        # an expert dropped reads as zeros; filled again it computes as before
        e = km.places["blk.0.ffn_gate_exps.weight"]
        slice_bytes = e.nbytes // 32
        assert km.drop("blk.0.ffn_gate_exps.weight", 0, 4 * slice_bytes) > 0
        assert not any(ctypes.string_at(e.addr + 4096, 4096).strip(b"\0"))
        km.fill("blk.0.ffn_gate_exps.weight", 0, 4 * slice_bytes)
        again = logits(km.model)
    finally:
        km.close()
    assert np.array_equal(got, want)  # bit for bit: the same bytes in the same buffers
    assert np.array_equal(again, want)
    assert np.isfinite(want).all() and want.std() > 0


def _resident(places) -> int:
    """Bytes of these memory ranges whose pages are resident (mincore), whole pages inside each."""
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, total = mmap.PAGESIZE, 0
    for p in places:
        a, b = -(-p.addr // page) * page, (p.addr + p.nbytes) // page * page
        if b > a:
            vec = (ctypes.c_ubyte * ((b - a) // page))()
            assert libc.mincore(ctypes.c_void_p(a), b - a, vec) == 0
            total += int((np.frombuffer(vec, np.uint8) & 1).sum()) * page
    return total


def test_a_source_with_bytes_in_its_padding_is_refused(files, tmp_path):
    """A restore writes zeros between the header and the data: a source with anything else there
    could not be given back bit for bit, so it is refused and nothing is written."""
    src = read_header(files["q4_0"])
    assert src.data_offset > src.header_size  # the padding this test writes into
    raw = bytearray(open(files["q4_0"], "rb").read())
    raw[src.header_size] = 1
    bad = tmp_path / "padded.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(MboltError, match=f"non-zero bytes between tensors \\(at byte {src.header_size}\\)"):
        write_kernel(bad, tmp_path / "k.gguf", AVX2)
    assert not (tmp_path / "k.gguf").exists()
