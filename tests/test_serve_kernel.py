"""`mbolt serve` and `mbolt chat` on a kernel-layout file (`mbolt repack`, issue 54): served by the
streaming runtime over it (runtime.kernel_stream), /stats, /metrics and the page's cache map from
the same view as the mapped runtime's, the prompt cache keyed by the file's own fingerprint, and
--plain refused in one line.

The model is test_serve's kind (a tiny qwen3moe with llama.cpp's Qwen2 test vocabulary and its chat
template) with Q4_0 experts, which llama.cpp's CPU backend repacks. The server runs as a real
process at the smallest budget that loads it (read from its own refusal of a smaller one), so its
cache holds k experts per layer and every step reads and evicts. What is checked comes from
outside the server: the official `openai` client's parsing; the greedy tokens of llama.cpp's own
default load of the stock file (its experts repacked by llama.cpp: the same kernels, so the same
logits bit for bit, test_kernel_stream) and of the stock file served by the mapped runtime (other
kernels: their sums differ in the last bits, so a near tie may go the other way, checked against
the reference's logits there); the expert count and MoE layers from gguf-py; the Prometheus text.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import EXPERT_GAIN, needs_llama, require_vocab
from test_serve import KEY, VOCAB, Server, _free_port, template_ids

pytestmark = needs_llama

KERNEL_MODEL = dict(arch="qwen3moe", n_layers=2, n_experts=32, n_used=4, hidden=64, expert_ff=256, n_heads=4,
                    n_kv_heads=2, head_dim=16, expert_type="Q4_0", dense_type="Q8_0", seed=7,
                    expert_gain=EXPERT_GAIN)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
N_NEW = 24
NEAR_TIE = 1e-3  # logits of two kernels' sums differ in the last bits: a top-2 gap this small may flip


def _mbolt(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "mbolt", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=300, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from mbolt.rewrite.kernel import write_kernel
    from mbolt.runtime.binding import lib
    from mbolt.runtime.kernel_load import this_build
    from mbolt.synth.synth import SynthConfig, write_synth

    d = tmp_path_factory.mktemp("serve_kernel")
    stock = write_synth(d / "chat.gguf", SynthConfig(**KERNEL_MODEL, vocab=str(require_vocab(VOCAB))))
    kl = d / "chat.kl.gguf"
    made = write_kernel(stock, kl, this_build(lib()))
    if not made.repacked:
        pytest.skip(f"this llama.cpp build ({made.build}) repacks no Q4_0 matrix: no kernel layout to serve")
    return stock, kl


class FloorServer(Server):
    """test_serve's server (its requests, stats, client and stop) at the smallest --ram that loads
    the model: what the same command's refusal of 8 MiB says it needs, and a little more (this
    process's memory moves by a MiB or two between runs)."""

    def __init__(self, model):
        cmd = [sys.executable, "-m", "mbolt", "serve", str(model), "-c", "1024", "--api-key", KEY, "--parallel", "1"]
        r = subprocess.run(cmd + ["--ram", "8M", "--port", "1"], capture_output=True, text=True, timeout=300)
        need = re.search(r"cannot hold .*: (\d+) MiB;", r.stderr)
        assert r.returncode == 2 and "Traceback" not in r.stderr and need, r.stderr
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(cmd + ["--ram", f"{int(need.group(1)) + 8}M", "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.wait_until_up()


@pytest.fixture(scope="module")
def kernel_server(files):
    s = FloorServer(files[1])
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def _served_tokens(server) -> list[int]:
    r = server.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=N_NEW, temperature=0,
                                                extra_body={"return_tokens": True})
    d = r.model_dump()
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == len(d["choices"][0]["tokens"])
    return d["choices"][0]["tokens"]


def _repacked_reference(stock, ids: list[int]) -> tuple[list[int], np.ndarray]:
    """llama.cpp's own default load of the stock file (its experts repacked by llama.cpp): the greedy
    tokens after `ids` and the logits each was the argmax of."""
    from mbolt.runtime.driver import open_driver

    with open_driver(stock, reads=False, evict=False, repacked=True, n_ctx=1024) as d:
        steps = list(d.decode(ids, N_NEW - 1))
    logits = np.stack([lg for _, lg in steps])
    return [int(np.argmax(lg)) for lg in logits], logits


def test_a_kernel_file_serves_llama_cpps_repacked_greedy_tokens(files, kernel_server, tmp_path):
    stock, kl = files
    ids = template_ids(kl, MESSAGES)
    got = _served_tokens(kernel_server)
    want, logits = _repacked_reference(stock, ids)
    assert len(got) > 0 and got == want[:len(got)]  # the same kernels over the same bytes: the same tokens
    st = kernel_server.stats()
    assert st["mode"] == "mbolt runtime"
    assert st["expert_slots"] < KERNEL_MODEL["n_experts"]  # streamed: the cache holds a few experts
    # experts came and went: more misses than distinct (layer, expert) pairs could make without evictions
    assert st["cache_misses"] > KERNEL_MODEL["n_layers"] * KERNEL_MODEL["n_experts"], st
    # the stock file served by the mapped runtime: the same model, computed by other kernels
    other = Server(stock, tmp_path, "--ram", "2G")
    try:
        mapped = _served_tokens(other)
    finally:
        err = other.stop()
    assert "Traceback" not in err, err
    first = next((i for i, (a, b) in enumerate(zip(got, mapped)) if a != b), None)
    if first is not None:  # only where the reference's top two were a near tie
        top = np.sort(logits[first])[-2:]
        assert top[1] - top[0] <= NEAR_TIE * max(1.0, abs(top[1])), (first, got, mapped, top)
    else:
        assert got[:len(mapped)] == mapped[:len(got)]


def _bits(hexes: list[str], n: int) -> np.ndarray:
    """The page's bitmaps (bit p of each hex string, position 0 first) as rows of n."""
    return np.stack([np.unpackbits(np.frombuffer(bytes.fromhex(h), np.uint8), bitorder="little")[:n] for h in hexes])


def test_stats_and_metrics_show_the_kernel_runtimes_cache(files, kernel_server):
    from gguf import GGUFReader

    stock, _ = files
    _served_tokens(kernel_server)
    st = kernel_server.stats()
    r = GGUFReader(str(stock))
    n_experts = int(r.fields["qwen3moe.expert_count"].parts[-1][0])
    moe = sorted({int(t.name.split(".")[1]) for t in r.tensors if t.name.endswith("_exps.weight")})
    m = st["cache_map"]
    assert m["n_experts"] == n_experts and m["layers"] == moe and len(m["cached"]) == len(moe)
    assert all(len(h) == 2 * -(-n_experts // 8) for h in m["cached"] + m["used"])
    assert m["read"] is None  # the kernel layout does not mark its reads
    cached, used = _bits(m["cached"], n_experts), _bits(m["used"], n_experts)
    # the last step was a decode step of one conversation: k experts per layer, held by the cache
    assert (used.sum(axis=1) == KERNEL_MODEL["n_used"]).all(), m
    assert (cached[used == 1] == 1).all() and (cached.sum(axis=1) <= st["expert_slots"]).all()
    assert st["cache_hits"] + st["cache_misses"] > 0 and st["decode_read_bytes"] > 0
    status, body, _ = kernel_server.get("/metrics")
    text = body.decode()
    assert status == 200
    assert f"mbolt_expert_cache_misses_total {float(st['cache_misses'])}" in text  # nothing served between
    assert f"mbolt_expert_slots {float(st['expert_slots'])}" in text


def test_the_prompt_cache_keeps_a_kernel_files_states_apart(files, tmp_path):
    """A state saved by the kernel file's server is restored by its next one, and a stock file's
    server on the same directory does not take it (its KV states come from other kernels)."""
    stock, kl = files
    cache = tmp_path / "cache"
    system = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 4}  # worth a file
    first, second = [system, MESSAGES[1]], [system, {"role": "user", "content": "What is two plus two?"}]
    for i, (path, messages, restored) in enumerate(((kl, first, False), (stock, second, False), (kl, second, True))):
        (tmp_path / str(i)).mkdir()
        s = Server(path, tmp_path / str(i), "--prompt-cache", str(cache), "--prompt-cache-size", "64M")
        try:
            r = s.client().chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
            text = s.get("/metrics")[1].decode()
        finally:
            err = s.stop()
        assert "Traceback" not in err, err
        assert (r.usage.prompt_tokens_details.cached_tokens > 0) == restored, (i, r.usage)
        assert ("mbolt_prompt_cache_restores_total 1.0" in text) == restored, text
    assert len([p for p in cache.iterdir() if p.suffix == ".kv"]) == 2  # one of each file, neither loaded by the other


def test_plain_refuses_a_kernel_file_in_one_line(files):
    _, kl = files
    for cmd in ("serve", "chat"):
        r = _mbolt(cmd, kl, "--plain", "-c", "1024")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and kl.name in lines[0] and "--plain" in lines[0] and "repack --restore" in lines[0]


def test_chat_in_the_terminal_on_a_kernel_file(files):
    _, kl = files
    p = _mbolt("chat", kl, "--ram", "2G", "-c", "1024", "--temp", "0", stdin="Hello\n/exit\n")
    assert p.returncode == 0, p.stderr
    assert "kernel layout" in p.stderr  # the budget line says how the experts are held
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("[")]
    assert len(lines) == 1 and "hit rate" in lines[0], p.stderr
    assert p.stdout.strip()


def test_a_kernel_file_is_served_with_slots_from_its_budget(files):
    """Without --parallel the budget chooses the slots (serve.model.auto_parallel): planned over the
    kernel file's stand-in, as its load is."""
    from mbolt.serve.model import MAX_AUTO_PARALLEL, auto_parallel

    stock, kl = files
    # a model this small under 2 GiB: the most slots, as for the stock file
    assert auto_parallel(str(kl), 1024, 512, 2 << 30) == auto_parallel(str(stock), 1024, 512, 2 << 30) == \
        MAX_AUTO_PARALLEL
    assert auto_parallel(str(kl), 1024, 512, None) == 1


def test_the_server_reads_the_runtime_through_its_driver():
    """serve/ and the serve and chat commands reach no arm (`.arm`) nor store: plain or streaming
    is `driver.streaming`, the numbers `driver.runtime_view()` (issue 56)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "mbolt"
    files = sorted((root / "serve").glob("*.py")) + [root / "cli" / "serve.py"]
    found = [f"{p.relative_to(root.parent)}:{node.lineno} .{node.attr}" for p in files
             for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, ast.Attribute) and node.attr in ("arm", "store", "runner")]
    assert found == [], found
