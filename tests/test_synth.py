"""Synthetic MoE models: shapes, determinism, expert types, planted structure, llama.cpp loading."""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections import Counter

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.errors import MboltError
from mbolt.core.moe_map import moe_map
from mbolt.synth.synth import PRESETS, SYNTH_ARCHS, SynthConfig, synth_tensors, write_synth

from conftest import needs_llama

ARCHS = ["qwen3moe", "olmoe", "mixtral", "qwen2moe"]
GGUF_ARCH = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "qwen2moe": "qwen2moe"}
# bytes per block / elements per block, written out by hand (ggml's block layouts)
BLOCK = {"F32": (4, 1), "F16": (2, 1), "BF16": (2, 1), "Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32),
         "Q5_0": (22, 32), "Q5_1": (24, 32), "MXFP4": (17, 32)}


def small(arch="qwen3moe", **kw) -> SynthConfig:
    kw.setdefault("n_kv_heads", 4 if arch == "olmoe" else 2)
    return SynthConfig(arch=arch, **kw)


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_archs_exported():
    assert sorted(SYNTH_ARCHS) == sorted(ARCHS + ["glm4moe", "deepseek2", "gpt-oss", "qwen3next"])
    assert set(PRESETS) == {"qwen3-30b-a3b", "qwen3-next-80b-a3b", "olmoe-1b-7b", "granite-moe-1b",
                            "glm-4.5-air", "deepseek-v3", "gpt-oss-20b", "glm-5.2"}


@pytest.mark.parametrize("arch", ARCHS)
def test_small_model_shapes(tmp_path, arch):
    cfg = small(arch, n_layers=3, n_experts=8, n_used=2, hidden=64, expert_ff=32)
    path = write_synth(tmp_path / "m.gguf", cfg)
    r = GGUFReader(path)  # independent reader
    names = {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == GGUF_ARCH[arch]
    for i in range(3):
        assert names[f"blk.{i}.ffn_gate_exps.weight"] == (64, 32, 8)
        assert names[f"blk.{i}.ffn_up_exps.weight"] == (64, 32, 8)
        assert names[f"blk.{i}.ffn_down_exps.weight"] == (32, 64, 8)
        assert names[f"blk.{i}.ffn_gate_inp.weight"] == (64, 8)
        assert names[f"blk.{i}.attn_q.weight"] == (64, 4 * 16)
    if arch == "qwen3moe":
        assert names["blk.0.attn_q_norm.weight"] == (16,)  # per head
    if arch == "olmoe":
        assert names["blk.0.attn_q_norm.weight"] == (64,)  # full q width
        assert names["blk.0.attn_k_norm.weight"] == (64,)
    if arch == "qwen2moe":
        assert names["blk.0.ffn_gate_inp_shexp.weight"] == (64,)
        assert names["blk.0.ffn_up_shexp.weight"] == (64, 64)
        assert names["blk.0.attn_q.bias"] == (64,)
    m = moe_map(path)
    assert (m.arch, m.n_layers, m.n_experts, m.n_used) == (GGUF_ARCH[arch], 3, 8, 2)
    assert all(len(layer.weights) == 3 for layer in m.layers)
    assert len(m.layers[0].shared) == (4 if arch == "qwen2moe" else 0)


def test_vocabulary_is_byte_level_gpt2(tmp_path):
    path = write_synth(tmp_path / "m.gguf", small())
    r = GGUFReader(path)
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    assert bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "\u0120" and tokens[ord("\n")] == "\u010a"
    assert tokens[0] == "\u0100" and tokens[255] == "\u00ff"
    assert len(set(tokens[:256])) == 256
    f = r.fields["tokenizer.ggml.merges"]
    merges = [bytes(f.parts[i]).decode() for i in f.data]
    assert merges and all(m.replace(" ", "") in tokens for m in merges)
    bos = int(r.fields["tokenizer.ggml.bos_token_id"].parts[-1][0])
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    assert bos != eos and bos >= 256 and eos >= 256


def test_same_seed_same_bytes(tmp_path):
    cfg = small(expert_type="Q4_0", n_layers=2)
    a = write_synth(tmp_path / "a.gguf", cfg)
    b = write_synth(tmp_path / "b.gguf", SynthConfig(**{**cfg.__dict__}))
    c = write_synth(tmp_path / "c.gguf", small(expert_type="Q4_0", n_layers=2, seed=1))
    assert sha(a) == sha(b)
    assert sha(a) != sha(c)
    fa = write_synth(tmp_path / "fa.gguf", small(fast_random=True, expert_type="Q8_0"))
    fb = write_synth(tmp_path / "fb.gguf", small(fast_random=True, expert_type="Q8_0"))
    assert sha(fa) == sha(fb)


def test_converter_order_is_the_same_model_in_another_order(tmp_path):
    """--tensor-order converter: each block holds ffn_down_exps before gate and up (as llama.cpp's
    converter writes real models), every tensor's bytes those of the default file (gguf-py)."""
    r = CliRunner().invoke(app, ["synth", str(tmp_path / "c.gguf"), "--layers", "2", "--tensor-order", "converter"])
    assert r.exit_code == 0, r.output
    write_synth(tmp_path / "u.gguf", SynthConfig(n_layers=2))
    use, conv = GGUFReader(tmp_path / "u.gguf"), GGUFReader(tmp_path / "c.gguf")
    names = [t.name for t in conv.tensors if "_exps." in t.name and t.name.startswith("blk.0.")]
    assert names == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]
    assert [t.name for t in use.tensors if "_exps." in t.name and t.name.startswith("blk.0.")] == \
        ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"]
    by_name = {t.name: bytes(t.data.tobytes()) for t in use.tensors}
    assert sorted(by_name) == sorted(t.name for t in conv.tensors)
    assert all(by_name[t.name] == bytes(t.data.tobytes()) for t in conv.tensors)
    assert [t.role for t in moe_map(tmp_path / "c.gguf").moe_layers[0].weights] == ["down", "gate", "up"]


@pytest.mark.parametrize("qtype", list(BLOCK))
@pytest.mark.parametrize("fast", [False, True])
def test_expert_types_slices(tmp_path, qtype, fast):
    cfg = small(expert_type=qtype, fast_random=fast, n_layers=2, n_experts=8, hidden=64, expert_ff=32)
    path = write_synth(tmp_path / "m.gguf", cfg)
    m = moe_map(path)
    r = {t.name: t for t in GGUFReader(path).tensors}
    bpb, epb = BLOCK[qtype]
    raw = path.read_bytes()
    for layer in m.layers:
        for t in layer.weights:
            assert t.type == qtype
            assert t.slice_bytes == 64 * 32 // epb * bpb
            data = np.asarray(r[t.name].data)
            assert r[t.name].data_offset == t.data_offset
            slices = []
            for e in range(8):
                mine = raw[t.slice_offset(e):t.slice_offset(e) + t.slice_bytes]
                assert mine == data[e].tobytes()  # gguf-py's view of expert e
                slices.append(mine)
                values = dequantize(np.frombuffer(mine, np.uint8), GGMLQuantizationType[qtype])
                assert np.isfinite(values).all() and 0 < np.abs(values).max() < 10
            assert len(set(slices)) == 8  # every expert has its own bytes


def planted_share(path):
    """Route every vocabulary token's (RMS-normalised) embedding through each router; return the
    mean share of co-selected expert pairs that lie in the same planted group, and the heat."""
    r = GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    emb = np.asarray(t["token_embd.weight"].data, dtype=np.float64)
    x = emb / np.sqrt((emb**2).mean(axis=1, keepdims=True))
    n_layers = int(r.fields["qwen3moe.block_count"].parts[-1][0])
    k = int(r.fields["qwen3moe.expert_used_count"].parts[-1][0])
    E = int(r.fields["qwen3moe.expert_count"].parts[-1][0])
    groups = np.asarray(r.fields["mbolt.synth.groups"].contents()).reshape(n_layers, E)
    shares, heats = [], []
    for layer in range(n_layers):
        w = np.asarray(t[f"blk.{layer}.ffn_gate_inp.weight"].data, dtype=np.float64)
        top = np.argsort(-(x @ w.T), axis=1)[:, :k]
        g = groups[layer][top]
        same = (g[:, :, None] == g[:, None, :]).sum(axis=(1, 2)) - k
        shares.append(same.mean() / (k * (k - 1)))
        counts = np.bincount(top.ravel(), minlength=E)
        heats.append(counts.max() / counts.mean())
    return float(np.mean(shares)), float(np.mean(heats))


def test_planted_structure_in_router(tmp_path):
    geo = dict(n_layers=3, n_experts=32, n_used=4, hidden=128, expert_ff=32, n_groups=4, heat_skew=0.0)
    chance = (32 / 4 - 1) / 31  # another selected expert is in my group by chance
    planted, _ = planted_share(write_synth(tmp_path / "p.gguf", small(strength=0.7, **geo)))
    weak, _ = planted_share(write_synth(tmp_path / "w.gguf", small(strength=0.3, **geo)))
    none, _ = planted_share(write_synth(tmp_path / "n.gguf", small(structure="none", **geo)))
    assert planted > 0.9
    assert chance + 0.1 < weak < planted
    assert abs(none - chance) < 0.1


def test_heat_skew_makes_hot_experts(tmp_path):
    geo = dict(n_layers=3, n_experts=32, n_used=4, hidden=128, expert_ff=32, structure="none")
    _, flat = planted_share(write_synth(tmp_path / "f.gguf", small(heat_skew=0.0, **geo)))
    _, hot = planted_share(write_synth(tmp_path / "h.gguf", small(heat_skew=2.0, **geo)))
    assert hot > flat + 1.0


def test_optional_tensors_and_dense_layers(tmp_path):
    cfg = small(n_layers=3, probs_bias=True, expert_bias=True, dense_layers=1)
    m = moe_map(write_synth(tmp_path / "m.gguf", cfg))
    assert m.layers[0].dense and not m.layers[1].dense
    roles = {t.role for t in m.layers[1].experts}
    assert roles == {"router", "probs_bias", "gate", "up", "down", "gate_bias", "up_bias", "down_bias"}
    assert m.layers[1].role("down_bias").ne == (64, 8)
    assert m.unknown() == []


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_geometry(name):
    real = {  # from the models' HF config.json: layers, experts, k, hidden, expert ff, heads, kv heads, head dim
        "qwen3-30b-a3b": (48, 128, 8, 2048, 768, 32, 4, 128),
        "qwen3-next-80b-a3b": (48, 512, 10, 2048, 512, 16, 2, 256),
        "olmoe-1b-7b": (16, 64, 8, 2048, 1024, 16, 16, 128),
        "granite-moe-1b": (24, 32, 8, 1024, 512, 16, 8, 64),
        "glm-4.5-air": (46, 128, 8, 4096, 1408, 96, 8, 128),
        "deepseek-v3": (61, 256, 8, 7168, 2048, 128, 1, 192),  # MLA: head dim = qk_nope 128 + qk_rope 64
        "gpt-oss-20b": (24, 32, 4, 2880, 2880, 64, 8, 64),
        "glm-5.2": (78, 256, 8, 512, 256, 8, 1, 64),  # routing geometry of GLM-5.2, slices scaled down
    }[name]
    cfg = SynthConfig.from_preset(name)
    assert (cfg.n_layers, cfg.n_experts, cfg.n_used, cfg.hidden, cfg.expert_ff, cfg.n_heads,
            cfg.n_kv_heads, cfg.head_dim) == real
    L, E, k, H, ff, nh, nkv, hd = real
    small_cfg = SynthConfig.from_preset(name, n_layers=cfg.dense_layers + 4)
    assert small_cfg.n_experts == E
    shapes = {n: ne for n, ne, _ in synth_tensors(small_cfg)}
    last = small_cfg.n_layers - 1  # a MoE layer (and a full-attention one in qwen3next)
    assert shapes[f"blk.{last}.ffn_gate_exps.weight"] == (H, ff, E)
    assert shapes[f"blk.{last}.ffn_down_exps.weight"] == (ff, H, E)
    if cfg.arch == "deepseek2":
        assert shapes[f"blk.{last}.attn_q_b.weight"] == (cfg.q_lora_rank, nh * hd)
        assert shapes[f"blk.{last}.attn_k_b.weight"] == (hd - cfg.rope_dim, cfg.kv_lora_rank, nh)
    elif cfg.arch == "qwen3next":
        assert shapes[f"blk.{last}.attn_q.weight"] == (H, 2 * nh * hd)  # q and its gate
        assert shapes["blk.0.attn_qkv.weight"] == (H, 2 * 16 * 128 + 32 * 128)  # linear attention
    else:
        assert shapes[f"blk.{last}.attn_q.weight"] == (H, nh * hd)
        assert shapes[f"blk.{last}.attn_k.weight"] == (H, nkv * hd)
    if cfg.dense_layers:
        assert shapes["blk.0.ffn_gate.weight"] == (H, cfg.dense_ff) and "blk.0.ffn_gate_exps.weight" not in shapes
    assert f"blk.{last + 1}.attn_norm.weight" not in shapes


@pytest.mark.parametrize("bad, msg", [
    (dict(arch="gptoss"), "unknown arch"),
    (dict(expert_type="Q4_9"), "unknown expert type"),
    (dict(expert_type="Q4_K"), "needs --fast-random"),
    (dict(layer_types="1:Q9"), "unknown expert type"),
    (dict(layer_types="x"), "layer types"),
    (dict(n_used=9), "larger than the number of experts"),
    (dict(expert_type="Q4_0", expert_ff=48), "multiple of the Q4_0 block"),
    (dict(arch="olmoe", n_kv_heads=2), "kv heads == heads"),
    (dict(arch="qwen2moe", head_dim=32), "heads x head_dim == hidden"),
    (dict(structure="random"), "structure"),
    (dict(strength=1.5), "strength"),
    (dict(tensor_order="alphabetical"), "tensor order"),
])
def test_bad_config(tmp_path, bad, msg):
    with pytest.raises(MboltError, match=msg):
        write_synth(tmp_path / "m.gguf", SynthConfig(**bad))
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_cli_synth(tmp_path):
    runner = CliRunner()
    out = tmp_path / "m.gguf"
    res = runner.invoke(app, ["synth", str(out), "--arch", "qwen2moe", "--layers", "2", "--experts", "16",
                              "--k", "4", "--type", "q8_0", "--seed", "7", "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["bytes"] == out.stat().st_size
    assert info["arch"] == "qwen2moe" and info["geometry"]["n_experts"] == 16 and info["expert_type"] == "Q8_0"
    assert info["fingerprint"] == moe_map(out).fingerprint
    res = runner.invoke(app, ["synth", str(out)])
    assert res.exit_code == 2 and "--force" in res.stderr
    res = runner.invoke(app, ["synth", str(out), "--force", "--preset", "granite-moe-1b", "--layers", "1",
                              "--experts", "4", "--k", "2", "--hidden", "64", "--expert-ff", "32",
                              "--heads", "4", "--kv-heads", "2"])
    assert res.exit_code == 0, res.output
    assert moe_map(out).arch == "llama"
    res = runner.invoke(app, ["synth", str(tmp_path / "o.gguf"), "--arch", "olmoe", "--hidden", "128"])
    assert res.exit_code == 0, res.output  # kv heads and head_dim follow heads and hidden
    q = GGUFReader(tmp_path / "o.gguf").fields
    assert int(q["olmoe.attention.key_length"].contents()) * int(q["olmoe.attention.head_count"].contents()) == 128
    res = runner.invoke(app, ["synth", str(tmp_path / "x.gguf"), "--type", "Q9"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "Q9" in res.stderr


# ---- llama.cpp ----


def llama_logits(path, text=b"hello there, the cat sat"):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    toks = llm.tokenize(text, add_bos=False, special=False)
    llm.eval(toks)
    out = np.array(llm.scores[: len(toks)]), toks
    llm.close()
    return out


@needs_llama
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("context", [0.0, 1.0])
def test_llama_cpp_loads(tmp_path, arch, context):
    path = write_synth(tmp_path / "m.gguf", small(arch, context=context))
    logits, toks = llama_logits(path)
    assert toks[:4] == [256 + 1, ord("l"), ord("l"), ord("o")]  # merge "h e" -> "he"
    assert logits.shape == (len(toks), 256 + 4 + 2)
    assert np.isfinite(logits).all() and logits.std() > 0


@needs_llama
@pytest.mark.parametrize("qtype, fast", [("F16", False), ("Q8_0", False), ("Q4_0", False), ("MXFP4", False),
                                         ("Q4_0", True), ("MXFP4", True)])
def test_llama_cpp_expert_types(tmp_path, qtype, fast):
    path = write_synth(tmp_path / "m.gguf", small(expert_type=qtype, fast_random=fast))
    logits, _ = llama_logits(path)
    assert np.isfinite(logits).all()


class _GgmlTensor(ctypes.Structure):  # include/ggml.h, struct ggml_tensor (head of it)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def llama_routing(path, tokens):
    """{layer: int32 [n_tok, k]} expert ids llama.cpp selects (via cb_eval on ffn_moe_topk-N)."""
    import llama_cpp as L

    rec = {}

    @L.ggml_backend_sched_eval_callback
    def cb(t, ask, _ud):
        g = ctypes.cast(t, ctypes.POINTER(_GgmlTensor)).contents
        if not g.name.startswith(b"ffn_moe_topk-"):
            return not ask
        if ask:
            return True
        k = g.ne[0]
        rows = [np.ctypeslib.as_array(ctypes.cast(g.data + j * g.nb[1], ctypes.POINTER(ctypes.c_int32)), (k,)).copy()
                for j in range(g.ne[1])]
        rec[int(g.name.split(b"-")[1])] = np.stack(rows)
        return True

    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = 1
    cp.cb_eval = cb
    ctx = L.llama_init_from_model(model, cp)
    try:
        arr = (L.llama_token * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) == 0
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
    return rec


@needs_llama
def test_planted_structure_in_llama_routing(tmp_path):
    geo = dict(n_layers=4, n_experts=32, n_used=4, hidden=128, expert_ff=32, n_heads=4, n_kv_heads=2,
               head_dim=32, n_groups=4, expert_type="Q8_0")
    tokens = np.random.default_rng(3).integers(0, 256, 200).tolist()
    chance = (32 / 4 - 1) / 31
    result = {}
    for structure in ("planted", "none"):
        path = write_synth(tmp_path / f"{structure}.gguf", small(structure=structure, strength=0.7, **geo))
        groups = np.asarray(GGUFReader(path).fields["mbolt.synth.groups"].contents()).reshape(4, 32)
        routing = llama_routing(path, tokens)
        shares = []
        for layer in range(3):  # the last layer routes only the output token during prefill
            g = groups[layer][routing[layer]]
            assert routing[layer].shape == (200, 4)
            shares.append(((g[:, :, None] == g[:, None, :]).sum(axis=(1, 2)) - 4).mean() / 12)
        result[structure] = min(shares), max(shares)
    assert result["planted"][0] > 0.85
    assert abs(result["none"][0] - chance) < 0.1 and abs(result["none"][1] - chance) < 0.1


@needs_llama
def test_context_makes_routing_depend_on_context(tmp_path):
    """Share of positions whose expert set differs from the usual set of their token id."""
    geo = dict(n_layers=3, n_experts=32, n_used=4, hidden=128, expert_ff=32, n_heads=4, n_kv_heads=2,
               head_dim=32, n_groups=4, expert_type="Q8_0")
    rng = np.random.default_rng(7)
    tokens = rng.choice(256, 12, replace=False)[rng.integers(0, 12, 240)].tolist()
    chance = (32 / 4 - 1) / 31
    off, share = {}, {}
    for context in (0.0, 1.0):
        path = write_synth(tmp_path / f"c{context}.gguf", small(context=context, **geo))
        groups = np.asarray(GGUFReader(path).fields["mbolt.synth.groups"].contents()).reshape(3, 32)
        routing = llama_routing(path, tokens)
        off[context], share[context] = [], []
        for layer in range(2):
            by_token = {}
            for t, r in zip(tokens, routing[layer].tolist()):
                by_token.setdefault(t, []).append(tuple(sorted(r)))
            usual = sum(Counter(v).most_common(1)[0][1] for v in by_token.values())
            off[context].append(1 - usual / len(tokens))
            g = groups[layer][routing[layer]]
            share[context].append(((g[:, :, None] == g[:, None, :]).sum(axis=(1, 2)) - 4).mean() / 12)
    assert max(off[0.0]) < 0.1  # routing follows the token id
    assert np.mean(off[1.0]) > 0.15  # the context moves it
    assert min(share[1.0]) > chance + 0.3  # and the planted groups still show
