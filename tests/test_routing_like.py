"""`synth --routing-like`: routing fitted to a real model's profile. The fit's pieces by hand, and
llama.cpp's own routing of the written files on text the fit never saw (prompts.jsonl lines 100+)
against the profile, in the profile's cut, and its reuse from token to token against a real
trace's (BigMoeOnEdge's Qwen3-30B-A3B)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from typer.testing import CliRunner

from mbolt.cli import app
from mbolt.core.errors import MboltError
from mbolt.core.prompts import read_prompts
from mbolt.data import PROMPTS, QWEN3_30B_PROFILE, QWEN3_NEXT_80B_PROFILE, path
from mbolt.reference.tokenizer import Tokenizer
from mbolt.synth import routing_fit as rf
from mbolt.synth.routing_like import RoutingLike, layer_map
from mbolt.synth.routing_reuse import lru_hit_rates
from mbolt.synth.synth import SynthConfig, write_synth, write_synth_info
from mbolt.synth.vocabulary import vocabulary
from mbolt.layout.stats import profile_stats, routing_target, trace_stats

from conftest import needs_llama


def like(profile=QWEN3_30B_PROFILE, **kw) -> SynthConfig:
    """A small model of the profile's expert count; head_dim 128 as the benchmark models have."""
    t = routing_target(path(profile))
    geo = dict(arch="qwen3moe", n_layers=4, n_experts=t.n_experts, n_used=t.k, hidden=256, expert_ff=32, n_heads=2,
               n_kv_heads=1, head_dim=128, expert_type="Q4_0", dense_type="F16", fast_random=True, seed=1)
    geo.update(kw)
    return SynthConfig(routing_like=t, **geo)


def test_byte_tokens_are_llama_cpps():
    """The calibration text is tokenized as the built-in vocabulary tokenizes it (the reference
    tokenizer follows llama.cpp's, tests/test_tokenizer_llama.py)."""
    tokens, types, merges, bos, eos = vocabulary()
    tok = Tokenizer(tokens, types, merges, "gpt-2", bos, eos, False)
    texts = [p.text for p in read_prompts(path(PROMPTS))] + ["  the\n\tin 'the' a  at", "x" * 3 + " t"]
    for text in texts:
        assert rf.byte_tokens(text).tolist() == tok.encode(text, add_special=False), text


def test_layer_map():
    listed = np.array([0, 7, 13, 20, 27, 34, 40, 47])
    assert layer_map(8, listed) == listed.tolist()
    assert layer_map(4, listed) == [0, 13, 34, 47]  # positions round(j * 7 / 3)
    assert layer_map(1, listed) == [27]
    ten = layer_map(10, listed)
    assert ten[0] == 0 and ten[-1] == 47 and sorted(ten) == ten and len(set(ten)) == 8


def test_heads_peak_at_their_lag():
    for head_dim in (64, 128):
        h = rf.make_heads(4, head_dim, 1e6, 16, 16, np.random.default_rng(0))
        scores = h.scores(300)
        assert scores.argmax(axis=1).tolist() == [1, 2, 3, 4]
        # the neighbours of the lag get a few percent of its weight, everything else far less
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        assert (w[:, 1:5].max(axis=1) == 1).all()
        assert (w.sum(axis=1) < 1.2).all()


@pytest.mark.parametrize("change, msg", [
    (dict(n_experts=64), "has 128 experts"),
    (dict(arch="glm4moe"), "plain GQA"),
    (dict(arch="qwen2moe"), "plain GQA"),
    (dict(context=1.0), "drop --context"),
    (dict(head_dim=16, n_heads=4), "rotary pairs"),
    (dict(vocab="v.gguf"), "drop --vocab"),
    (dict(n_heads=1), "2 attention heads"),
])
def test_config_errors(change, msg):
    with pytest.raises(MboltError, match=msg):
        like(**change).validate()


def test_same_seed_same_bytes(tmp_path):
    """Two fits from two fresh loads of the profile write the same file."""
    shas = []
    for i in range(2):
        p = write_synth(tmp_path / f"m{i}.gguf", like(n_layers=2, hidden=128))
        shas.append(hashlib.sha256(p.read_bytes()).hexdigest())
    assert shas[0] == shas[1]


def _held_out(model, tmp_path, lo=100, hi=140):
    """llama.cpp's routing of prompts lo..hi-1 (prompt tokens only) and its trace-stats."""
    from mbolt.trace.tracer import trace_prompts

    out = tmp_path / "held.mbtrace"
    trace_prompts(model, read_prompts(path(PROMPTS))[lo:hi], out, max_new_tokens=0, engine="llama.cpp")
    return out, trace_stats(out, phase="prefill")


def _mapped(profile: str, layers: list[int]) -> dict:
    rows = {r["layer"]: r for r in profile_stats(path(profile))["layers"]}
    return {key: float(np.mean([rows[l][key] for l in layers]))
            for key in ("entropy_norm", "top10_share", "cut_lift_p50")}


@pytest.fixture(scope="module")
def qwen30(tmp_path_factory):
    """A 4-layer model following the Qwen3-30B-A3B profile, and llama.cpp's routing of prompts
    100-139 (prompt tokens only)."""
    d = tmp_path_factory.mktemp("qwen30")
    cfg = like()
    info = write_synth_info(d / "m.gguf", cfg)
    trace, stats = _held_out(info.path, d)
    return cfg, info, trace, stats


@needs_llama
def test_llama_routing_is_the_simulated_routing(qwen30):
    """The fit simulates llama.cpp: on unseen text llama.cpp picks the sets the simulation picks
    (layer 0 reads only the embeddings and layer 0's attention; later layers also read the
    fast-random experts' outputs, which the simulation leaves out)."""
    from mbolt.core.mbtrace import read_trace

    cfg, _, trace, _ = qwen30
    tr = read_trace(trace)
    plant = RoutingLike(cfg, 262)  # the cached fit
    tokens = [rf.byte_tokens(p.text) for p in read_prompts(path(PROMPTS))[100:140]]
    z = rf.latent(np.concatenate(tokens), plant.codes, rf.head_context(tokens, plant.codes, plant.heads),
                  plant.heads.mix(plant.fit.share, plant.fit.gain))
    assert len(z) == tr.n_tokens
    for layer in range(3):  # the last layer routes only each prompt's last token
        f = plant.layer_fit[layer]
        sim = np.sort(rf.simulate(z, f.A, f.b, cfg.n_used), axis=1)
        real = np.sort(tr.experts[:, layer].astype(np.int64), axis=1)
        same = (sim == real).all(axis=1).mean()
        shared = (sim[:, :, None] == real[:, None, :]).sum(axis=(1, 2)).mean() / cfg.n_used
        assert same > (0.98 if layer == 0 else 0.8) and shared > 0.95, (layer, same, shared)


@needs_llama
@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_other_families_route_as_simulated(tmp_path, arch):
    """mixtral: llama.cpp's NORM rope (pairs of neighbouring dims) and no q/k norm; olmoe: its q/k
    norm spans every head. Layer 0 picks the simulated sets."""
    from mbolt.core.mbtrace import read_trace

    cfg = like(arch=arch, n_layers=2, n_kv_heads=2 if arch == "olmoe" else 1)
    model = write_synth(tmp_path / "m.gguf", cfg)
    trace, _ = _held_out(model, tmp_path, 100, 110)
    tr = read_trace(trace)
    plant = RoutingLike(cfg, 262)
    tokens = [rf.byte_tokens(p.text) for p in read_prompts(path(PROMPTS))[100:110]]
    z = rf.latent(np.concatenate(tokens), plant.codes, rf.head_context(tokens, plant.codes, plant.heads),
                  plant.heads.mix(plant.fit.share, plant.fit.gain))
    f = plant.layer_fit[0]
    sim = np.sort(rf.simulate(z, f.A, f.b, cfg.n_used), axis=1)
    assert (sim == np.sort(tr.experts[:, 0].astype(np.int64), axis=1)).all(axis=1).mean() > 0.98


@needs_llama
def test_qwen3_30b_profile_reproduced_on_unseen_text(qwen30):
    """Measured by trace-stats on llama.cpp's routing of prompts 100-139, against the profile
    layers the model follows and against the whole profile (the issue's targets: entropy within
    0.03, hottest 10% share, median cut lift and overlap / heat overlap within 20%)."""
    _, info, _, s = qwen30
    layers = info.extra["routing_like"]["profile_layers"]
    assert layers == [0, 13, 34, 47]
    cut = s["profile_cut"]
    assert cut["left_out"] == [3] and s["tokens"]["prefill"] > 8000
    want = _mapped(QWEN3_30B_PROFILE, layers[:3])
    assert abs(cut["entropy_norm"] - want["entropy_norm"]) < 0.03
    assert cut["top10_share"] == pytest.approx(want["top10_share"], rel=0.2)
    assert cut["cut_lift_p50"] == pytest.approx(want["cut_lift_p50"], rel=0.2)
    whole = profile_stats(path(QWEN3_30B_PROFILE))["profile_cut"]
    assert abs(cut["entropy_norm"] - whole["entropy_norm"]) < 0.03
    for key in ("top10_share", "cut_lift_p50"):
        assert cut[key] == pytest.approx(whole[key], rel=0.2), key
    for x in s["layers"][:3]:  # each layer, not only the mean
        row = _mapped(QWEN3_30B_PROFILE, [layers[x["layer"]]])
        assert abs(x["entropy_norm"] - row["entropy_norm"]) < 0.03
        assert x["cut_lift_p50"] == pytest.approx(row["cut_lift_p50"], rel=0.2)


@needs_llama
def test_qwen3_next_80b_shape_loads_generates_and_follows(tmp_path):
    """The 72 KiB benchmark model's routing geometry (512 experts, k=10, 4 heads of 128, one kv
    head, expert ff 64) at a small hidden size: llama.cpp loads and generates, and its routing
    of unseen text follows the 80B profile."""
    from llama_cpp import Llama

    cfg = like(QWEN3_NEXT_80B_PROFILE, n_layers=3, hidden=512, expert_ff=64, n_heads=4)
    info = write_synth_info(tmp_path / "m.gguf", cfg)
    llm = Llama(model_path=info.path, n_ctx=64, n_threads=2, verbose=False)
    out = llm("The quick brown fox", max_tokens=4, temperature=0)
    llm.close()
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["text"]
    layers = info.extra["routing_like"]["profile_layers"]
    _, s = _held_out(info.path, tmp_path, 100, 130)
    cut = s["profile_cut"]
    want = _mapped(QWEN3_NEXT_80B_PROFILE, layers[:2])
    assert abs(cut["entropy_norm"] - want["entropy_norm"]) < 0.03
    assert cut["top10_share"] == pytest.approx(want["top10_share"], rel=0.2)
    assert cut["cut_lift_p50"] == pytest.approx(want["cut_lift_p50"], rel=0.2)


def test_cli(tmp_path, data_dir):
    out = tmp_path / "m.gguf"
    args = ["synth", str(out), "--arch", "qwen3moe", "--layers", "2", "--experts", "128", "--k", "8", "--hidden", "128",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "128", "--routing-like", str(data_dir / QWEN3_30B_PROFILE)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    said = " ".join(r.stdout.split())  # rich wraps lines
    assert "routing like coactivation_qwen3-30b-a3b.8layers.json" in said and "median pair lift" in said
    from gguf import GGUFReader

    f = GGUFReader(str(out)).fields
    assert bytes(f["mbolt.synth.routing_like"].parts[-1]).decode() == QWEN3_30B_PROFILE
    r = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "missing.json"), "--force"])
    assert r.exit_code == 2


# BigMoeOnEdge's qwen.route.csv (Qwen3-30B-A3B Q4_K_M, 48 x 128, top-6, the 128 decode tokens of one
# chat turn; ../shared/data/bigmoeonedge, Apache-2.0), replayed per layer from a cold cache with
# one SlotLru per layer, means over the 48 layers (../shared/DESIGN.md; measured again for #35)
REAL_SLOTS, REAL_LRU_HITS, REAL_OVERLAP, REAL_K = (16, 27, 51), (0.609, 0.756, 0.897), 0.380, 6


def test_lru_hit_rates_are_the_slot_lrus():
    """The fit's all-at-once LRU counts what one SlotLru per passage counts (hand-made passages:
    a loop over two sets, a cycle of fresh experts, random sets)."""
    from mbolt.layout.evaluate import lru_hits

    rng = np.random.default_rng(3)
    loop = np.array([[0, 1, 2], [3, 4, 5]] * 10)
    fresh = np.arange(60).reshape(20, 3)
    rand = np.array([rng.choice(16, 3, replace=False) for _ in range(40)])
    sel = np.concatenate([loop, fresh, rand[:20], rand[20:]])
    starts = np.array([0, 20, 40, 60])
    for slots in (2, 3, 6, 7, 12):
        want = np.mean([lru_hits(sel[a:a + 20, None, :], 64, slots).mean() for a in starts])
        assert lru_hit_rates(sel, starts, 20, [slots])[0] == pytest.approx(want), slots
    assert lru_hit_rates(loop, np.array([0]), 20, [6])[0] == pytest.approx(18 * 3 / 60)  # all but the first two
    assert lru_hit_rates(fresh, np.array([0]), 20, [59])[0] == 0


def _reuse(trace, k: int, layers, window: int = 128):
    """Per-layer LRU hit rates at REAL_SLOTS (each whole `window`-token passage of a prompt from a
    cold SlotLru, as the real trace's decode) and consecutive overlap, of the top-k in rank order;
    means over `layers`."""
    from mbolt.core.mbtrace import read_trace
    from mbolt.layout.evaluate import lru_hits

    tr = read_trace(trace)
    starts = [a for s in np.unique(tr.seq) for i in [np.flatnonzero(tr.seq == s)]
              for a in i[0] + np.arange(0, len(i) - window + 1, window)]
    assert len(starts) >= 20
    same = tr.seq[1:] == tr.seq[:-1]
    hits, overlaps = [], []
    for layer in layers:
        sets = tr.experts[:, layer:layer + 1, :k].astype(np.int64)
        hits.append([np.mean([lru_hits(sets[a:a + window], tr.n_experts, c).mean() for a in starts])
                     for c in REAL_SLOTS])
        x = np.zeros((tr.n_tokens, tr.n_experts), bool)
        np.put_along_axis(x, sets[:, 0], True, axis=1)
        overlaps.append((x[1:] & x[:-1]).sum(axis=1)[same].mean() / k)
    return np.mean(hits, axis=0), float(np.mean(overlaps))


def _long_held_out(n_tokens: int) -> list:
    """Unseen prompts (100+) of two 128-token passages or more, until about n_tokens."""
    out, total = [], 0
    for p in read_prompts(path(PROMPTS))[100:]:
        n = len(rf.byte_tokens(p.text))
        if n >= 256 and total < n_tokens:
            out.append(p)
            total += n
    return out


@needs_llama
def test_q864_twin_at_k6_reuses_like_qwen3_30b(tmp_path):
    """A q864 twin (Qwen3-30B-A3B's 128 experts and head_dim, 4 lag heads and the window head) at
    the real trace's k=6: llama.cpp's routing of unseen text has the real trace's LRU hit rates
    at 16 / 27 / 51 slots and its consecutive overlap (8.1x chance) within 20%."""
    from mbolt.trace.tracer import trace_prompts

    cfg = like(n_used=REAL_K, n_heads=5)
    info = write_synth_info(tmp_path / "m.gguf", cfg)
    out = tmp_path / "held.mbtrace"
    trace_prompts(info.path, _long_held_out(6000), out, max_new_tokens=0, engine="llama.cpp")
    hits, overlap = _reuse(out, REAL_K, range(3))  # the last layer routes only each prompt's last token
    assert hits == pytest.approx(REAL_LRU_HITS, rel=0.2), hits
    assert overlap == pytest.approx(REAL_OVERLAP, rel=0.2)
    assert info.extra["routing_like"]["gain"] > 0 and info.extra["routing_like"]["share"] == 0


@needs_llama
def test_k8_model_gets_the_same_reuse(qwen30):
    """The k=8 model (the benchmark models' k) is fitted to the same reuse: the top 6 of its
    selections, in rank order, reuse as the real trace's top-6 (within 20%)."""
    _, _, trace, _ = qwen30
    hits, overlap = _reuse(trace, REAL_K, range(3))
    assert hits == pytest.approx(REAL_LRU_HITS, rel=0.2), hits
    assert overlap == pytest.approx(REAL_OVERLAP, rel=0.2)


@needs_llama
def test_zero_attention_typed_as_a_real_file_computes_the_same(tmp_path):
    """typed_zero_attention (the q4kmq benchmark model): the attention of layers past the first,
    all zeros, written in the Q4_K_M mix's types instead of F16. gguf-py reads those tensors in the
    mix's types and all zero, layer 0's attention byte for byte the F16 file's; the file is smaller
    by the difference; and llama.cpp computes the same logits from both (zeros are exact in every
    type), bit for bit."""
    from gguf import GGUFReader

    from mbolt.runtime.driver import open_driver

    kw = dict(n_layers=3, hidden=256, n_heads=2, n_kv_heads=1, dense_type="Q4_K_M")
    f16, typed = tmp_path / "f16.gguf", tmp_path / "typed.gguf"
    write_synth(f16, like(**kw))
    write_synth(typed, like(typed_zero_attention=True, **kw))
    a = {t.name: t for t in GGUFReader(f16).tensors}
    b = {t.name: t for t in GGUFReader(typed).tensors}
    assert a.keys() == b.keys()
    attn = [n for n in a if ".attn_" in n and n.endswith(("q.weight", "k.weight", "v.weight", "output.weight"))]
    assert len(attn) == 3 * 4
    for n in attn:
        if n.startswith("blk.0."):
            assert b[n].tensor_type.name == "F16" and bytes(a[n].data) == bytes(b[n].data), n
        else:
            assert a[n].tensor_type.name == "F16" and not np.asarray(a[n].data).any(), n
            assert b[n].tensor_type.name not in ("F16", "F32") and not np.asarray(b[n].data).any(), n
    saved = sum(int(a[n].n_bytes) - int(b[n].n_bytes) for n in attn)
    assert saved > 0 and f16.stat().st_size - typed.stat().st_size >= saved - 2 * 32 * len(attn)
    ids = [int(t) for t in rf.byte_tokens(" ".join(p.text for p in read_prompts(path(PROMPTS))[100:104]))[:48]]
    assert len(ids) == 48
    logits = []
    for m in (f16, typed):
        with open_driver(str(m), reads=False, evict=False, n_ctx=256) as d:
            logits.append(np.stack([lg for _, lg in d.decode(ids[:40], 8, fed=ids[40:])]))
    assert np.array_equal(logits[0], logits[1])
