"""The prompt cache (issue 55): KV states of prompt prefixes on disk, restored across requests,
slots and restarts; prefixes copied between slots in memory; `cached_tokens` in both APIs' usage.

The model is test_serve's tiny qwen3moe with llama.cpp's Qwen2 test vocabulary and the chat
template that vocabulary carries. What is checked comes from outside the cache: llama.cpp's logits
of a cold evaluation against the restored state's (and a different prefix's, which must differ:
the comparison can see a wrong state), the greedy reply of a scheduler without a cache, the number
of cached tokens from the template rendered by jinja2 here and tokenized by llama.cpp, the official
`openai` and `anthropic` clients' parsing, the Prometheus text, the files on disk.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import tempfile
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_llama, require_vocab
from test_serve import CHAT_MODEL, VOCAB, Server, template_ids, write_chat_model

pytestmark = needs_llama

SYS = "You are a careful assistant who answers briefly and names the units of every number. " * 3
SYS_B = "You are a pirate who speaks only in rhymes about the sea and its ships. " * 3


def _chat(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("pc") / "chat.gguf", require_vocab(VOCAB))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, model):
    """The same shapes and vocabulary, other weights: another fingerprint."""
    from mbolt.synth.synth import write_synth

    path = tmp_path_factory.mktemp("pc_other") / "other.gguf"
    write_synth(path, dataclasses.replace(CHAT_MODEL, vocab=str(VOCAB), seed=8))
    return path


class Open:
    """A model loaded with a scheduler over it, a prompt cache on `directory` (None: no cache)."""

    def __init__(self, model, directory: Path | None, *, parallel: int = 1, size: int = 1 << 30):
        from mbolt.serve.model import open_model
        from mbolt.serve.prompt_cache import PromptCache, layout_of
        from mbolt.serve.scheduler import Scheduler

        self.lines: list[str] = []
        self.loaded = open_model(model, ram="2G", n_ctx=1024, parallel=parallel)
        self.cache = (PromptCache(directory, size, layout_of(self.loaded.driver), say=self.lines.append)
                      if directory is not None else None)
        self.sched = Scheduler(self.loaded, prompt_cache=self.cache)

    def submit(self, messages, n: int = 24):
        from mbolt.serve.scheduler import SAMPLING_DEFAULTS, Job

        ids, stop = self.sched.prepare_chat(messages)
        q: queue.Queue = queue.Queue()
        self.sched.submit(Job(ids, n, {**SAMPLING_DEFAULTS, "temperature": 0}, stop, lambda k, d: q.put((k, d))))
        return ids, q

    @staticmethod
    def wait(q, on_text=None) -> dict:
        while True:
            k, d = q.get(timeout=120)
            if k == "end":
                return d
            if k == "error":
                raise AssertionError(d)
            if on_text is not None:
                on_text()

    def run(self, messages, n: int = 24) -> dict:
        return self.wait(self.submit(messages, n)[1])

    def flush(self):
        if self.cache is not None:
            self.cache.flush()

    def save_prefix(self, ids: list[int], n: int, seq: int = 0):
        """Slot `seq` prompted with ids[:n] and its state saved to disk (written before this returns);
        returns the logits of that slot going on with ids[n:]: what the restored state must give."""
        d = self.loaded.driver
        d.prompt(ids[:n], seq=seq)
        self.cache.save(d, seq)
        self.flush()
        return d.runner.eval(ids[n:], seq=seq)

    def close(self):
        self.sched.close()
        self.loaded.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cold(model, messages, n: int = 24) -> dict:
    """The reply with nothing restored: a cache on an empty directory, so the prompt's passes are
    the ones a restore continues (the first ends at the last user turn). A prompt evaluated in other
    passes may end in other last bits (llama.cpp's kernels depend on the batch's size) and, after
    enough greedy tokens, in another reply: the same holds for a slot's own reused prefix."""
    with tempfile.TemporaryDirectory() as d, Open(model, Path(d)) as o:
        end = o.run(messages, n)
    assert end["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return end


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix == ".kv")


def _turn_start(model, messages) -> int:
    """Where the last user turn starts: the common prefix of the whole conversation's tokens and
    those of the conversation before it."""
    a, b = template_ids(model, messages), template_ids(model, messages[:-1])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- the state itself ----


def test_a_restored_state_gives_llama_cpps_logits(model, tmp_path):
    """Saved by a server of one slot, restored into the second slot of a server of two: the next
    token's logits are, bit for bit, those of the slot that computed the prefix going on; another
    prefix's differ."""
    with Open(model, tmp_path) as o:
        ids = template_ids(model, _chat(SYS, "Name three colours."))
        cold = o.save_prefix(ids, 40)
        d = o.loaded.driver
        d.forget(0)
        d.prompt(template_ids(model, _chat(SYS_B, "Name three colours."))[:40], seq=0)
        wrong = d.runner.eval(ids[40:], seq=0)
    assert len(_files(tmp_path)) == 1
    with Open(model, tmp_path, parallel=2) as o:
        from mbolt.serve.prefixes import reuse

        d = o.loaded.driver
        got = reuse(d, 1, ids, o.cache, set())
        assert (got.source, got.cached, got.todo) == ("disk", 40, ids[40:])
        restored = d.runner.eval(got.todo, seq=1)
    np.testing.assert_array_equal(restored, cold)
    assert np.abs(wrong - cold).max() > 1e-2


def test_the_same_greedy_reply_after_a_restart(model, tmp_path):
    first, second = _chat(SYS, "Name three colours."), _chat(SYS, "What is two plus two?")
    want = _cold(model, second)
    assert want["tokens"] != _cold(model, _chat(SYS_B, "What is two plus two?"))["tokens"]  # it can fail
    with Open(model, tmp_path) as o:
        end = o.run(first)
        o.flush()
        assert end["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert o.sched.stats()["prompt_cache_saves"] == 1
    (f,) = _files(tmp_path)
    n = _turn_start(model, first)
    assert f.name.endswith(f"-{n}.kv") and n >= 16  # saved up to the last user turn
    with Open(model, tmp_path) as o:  # a new server on the same directory
        end = o.run(second)
        st = o.sched.stats()
    assert end["tokens"] == want["tokens"]
    assert end["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert end["prompt_tokens_evaluated"] == len(end["prompt_tokens"]) - n == st["prompt_tokens"]
    assert st["prompt_cache_restores"] == 1 and st["prompt_cache_restored_tokens"] == n
    assert st["prompt_cache_saves"] == 0 and len(_files(tmp_path)) == 1  # the prefix was on disk already


# ---- files that do not match ----


def _saved(model, directory: Path) -> Path:
    with Open(model, directory) as o:
        o.run(_chat(SYS, "Name three colours."), n=4)
        o.flush()
    (f,) = _files(directory)
    return f


def _restore_skipped(model, directory: Path, reason: str) -> list[str]:
    """A request whose prefix a damaged or foreign file holds: evaluated cold, the file skipped
    with one line in the log and counted in /metrics."""
    from mbolt.serve.metrics import Metrics

    second = _chat(SYS, "What is two plus two?")
    want = _cold(model, second)
    with Open(model, directory) as o:
        end = o.run(second)
        o.run(second)  # asked again: the file is not read (nor said) twice
        text = Metrics(o.sched.stats).text().decode()
        lines, st = list(o.lines), o.sched.stats()
    assert end["tokens"] == want["tokens"] and end["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert st["prompt_cache_restores"] == 0 and st["prompt_cache_skipped"] == {reason: 1}
    assert f'mbolt_prompt_cache_skipped_total{{reason="{reason}"}} 1.0' in text
    skipped = [ln for ln in lines if "skipped" in ln]
    assert len(skipped) == 1 and "\n" not in skipped[0], lines
    return skipped


def test_a_file_of_another_model_is_skipped(model, other_model, tmp_path):
    f = _saved(other_model, tmp_path)
    (line,) = _restore_skipped(model, tmp_path, "model")
    assert str(f) in line and "another model" in line
    assert f.exists()  # another server's file: not this one's to delete


@pytest.mark.parametrize("where", ["state", "tokens", "header"])
def test_a_flipped_byte_is_skipped(model, tmp_path, where):
    f = _saved(model, tmp_path)
    raw = bytearray(f.read_bytes())
    n_head = int.from_bytes(raw[8:12], "little")
    at = {"header": 16 + n_head // 2, "tokens": 16 + n_head + 8, "state": len(raw) - len(raw) // 3}[where]
    raw[at] ^= 0x10
    f.write_bytes(bytes(raw))
    (line,) = _restore_skipped(model, tmp_path, "checksum")
    assert str(f) in line and "checksum" in line


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_file_is_skipped(model, tmp_path, keep):
    f = _saved(model, tmp_path)
    raw = f.read_bytes()
    f.write_bytes(raw[:int(len(raw) * keep)])
    (line,) = _restore_skipped(model, tmp_path, "truncated")
    assert str(f) in line and "truncated" in line


# ---- the directory ----


def test_least_recently_used_files_go_first(model, tmp_path):
    systems = [f"You are assistant number {i}, careful and brief, and you name units. " * 3 for i in range(3)]
    with Open(model, tmp_path) as o:
        o.run(_chat(systems[0], "Hi."), n=2)
        o.flush()
    (a,) = _files(tmp_path)
    size = int(2.5 * a.stat().st_size)  # two files fit, three do not
    with Open(model, tmp_path, size=size) as o:
        o.run(_chat(systems[1], "Hi."), n=2)
        o.flush()
        (b,) = set(_files(tmp_path)) - {a}
        os.utime(a, (1_000_000, 1_000_000))  # a older than b...
        os.utime(b, (2_000_000, 2_000_000))
        o.sched.driver.forget()
        end = o.run(_chat(systems[0], "Hello again."), n=2)  # ...until a is restored: b is the older now
        assert end["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and o.cache.counts["restores"] == 1
        o.sched.driver.forget()
        o.run(_chat(systems[2], "Hi."), n=2)  # a third file: b, the least recently used, goes
        o.flush()
        assert o.cache.counts["evicted"] == 1
    left = _files(tmp_path)
    assert len(left) == 2 and a in left and b not in left
    assert sum(f.stat().st_size for f in left) <= size


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a full filesystem: a tmpfs of 16 KiB when this test may mount one (root),
    else posix_fallocate made to fail with ENOSPC (what a full disk gives the cache's write)."""
    d = tmp_path / "tiny"
    d.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(d)],
                                                   capture_output=True).returncode == 0
    if mounted:
        (d / "filler").write_bytes(b"x" * 8192)
        yield d, None
        subprocess.run(["umount", str(d)], check=True)
        return
    real = os.posix_fallocate

    def fail(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.posix_fallocate = fail
    try:
        yield d, "patched"
    finally:
        os.posix_fallocate = real


def test_a_full_disk_loses_no_request(model, full_disk):
    d, how = full_disk
    msgs = _chat(SYS, "Name three colours.")
    want = _cold(model, msgs)
    with Open(model, d) as o:
        end = o.run(msgs)
        o.flush()
        st, lines = o.sched.stats(), list(o.lines)
    assert end["tokens"] == want["tokens"] and end["finish_reason"] in ("stop", "length")
    assert st["prompt_cache_saves"] == 0 and st["prompt_cache_save_failures"] == 1
    (line,) = [ln for ln in lines if "not saved" in ln]
    assert "No space left on device" in line, lines
    assert not [p for p in d.iterdir() if p.name != "filler"]  # no temporary file left


def test_two_servers_on_one_directory(model, tmp_path):
    """Two server processes save the same prefixes into one directory at once: every file is
    whole (a third server restores each, none skipped) and no temporary file is left."""
    cache = tmp_path / "cache"
    prompts = [_chat(s, "Name three colours.") for s in (SYS, SYS_B, SYS + " Be kind.", SYS_B + " Be bold.")]
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        servers.append(Server(model, tmp_path / name, "--prompt-cache", str(cache)))
    errors = []
    try:
        def go(srv, order):
            try:
                c = srv.client()
                for m in order * 2:
                    c.chat.completions.create(model="m", messages=m, max_tokens=2, temperature=0)
            except Exception as e:  # the assertion below names it
                errors.append(e)
        threads = [threading.Thread(target=go, args=(servers[0], prompts)),
                   threading.Thread(target=go, args=(servers[1], prompts[::-1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        logs = [srv.stop() for srv in servers]
    assert not errors, errors
    for err in logs:
        assert "Traceback" not in err and "skipped" not in err and "not saved" not in err, err
    assert not [p for p in cache.iterdir() if p.suffix != ".kv"]  # no temporary file left
    assert len(_files(cache)) == len(prompts)
    with Open(model, cache) as c:
        for p in prompts:
            follow = p[:1] + [{"role": "user", "content": "And four animals?"}]
            end = c.run(follow, n=2)
            assert end["usage"]["prompt_tokens_details"]["cached_tokens"] == _turn_start(model, follow)
            c.sched.driver.forget()
        assert not c.lines and c.cache.counts["restores"] == len(prompts)


# ---- in memory: slots ----


def test_a_copied_prefix_gives_llama_cpps_logits(model):
    """A prefix copied from another slot (llama_memory_seq_cp, then cut): the next token's logits
    are, bit for bit, those of the slot that computed it continuing itself; another prefix's differ."""
    ids = template_ids(model, _chat(SYS, "What is two plus two?"))
    held = template_ids(model, _chat(SYS, "Name three colours."))
    n = next(i for i, (x, y) in enumerate(zip(ids, held)) if x != y)
    with Open(model, None, parallel=2) as o:
        d = o.loaded.driver
        d.prompt(held, seq=0)
        assert d.copy_sequence(0, 1, n) and d.tokens[1] == ids[:n]
        copied = d.runner.eval(ids[n:], seq=1)
        assert d.keep_prefix(0, ids) == ids[n:]
        itself = d.runner.eval(ids[n:], seq=0)
        d.forget()
        d.prompt(template_ids(model, _chat(SYS_B, "Name three colours.")), seq=0)
        assert d.copy_sequence(0, 1, n)
        wrong = d.runner.eval(ids[n:], seq=1)
    np.testing.assert_array_equal(copied, itself)
    assert np.abs(wrong - itself).max() > 1e-2


def test_a_second_slot_copies_the_prefix_another_holds(model):
    """-np 2: the second request starts while the first replies; its prefix is copied, not evaluated.
    (Its reply is not compared token for token: its rows share llama_decodes with the other slot's,
    whose shapes move the last bits; the copy's logits are checked above.)"""
    first, second = _chat(SYS, "Name three colours."), _chat(SYS, "What is two plus two?")
    with Open(model, None, parallel=2) as o:
        ids1, q1 = o.submit(first, n=48)
        k, d = q1.get(timeout=120)  # the first reply is under way (its slot busy)
        assert k == "text"
        ids2, q2 = o.submit(second)
        end2 = o.wait(q2)
        end1 = o.wait(q1)
        st = o.sched.stats()
    common = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    assert end1["slot"] != end2["slot"] and st["kv_copies"] == 1
    assert end2["usage"]["prompt_tokens_details"]["cached_tokens"] == common
    assert end2["prompt_tokens_evaluated"] == len(ids2) - common  # fewer than the prompt: the rest was copied
    assert st["prompt_tokens"] == len(ids1) + len(ids2) - common and st["cached_tokens"] == common


# ---- the APIs ----


def test_cached_tokens_through_the_official_clients(model, tmp_path):
    import anthropic

    from test_serve import KEY

    cache = tmp_path / "cache"
    first = _chat(SYS, "Name three colours.")
    second = _chat(SYS, "What is two plus two?")
    srv = Server(model, tmp_path, "--prompt-cache", str(cache), "--prompt-cache-size", "64M")
    try:
        r = srv.client().chat.completions.create(model="m", messages=first, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        err = srv.stop()
    assert "Traceback" not in err, err
    assert len(_files(cache)) == 1
    (tmp_path / "again").mkdir()
    srv = Server(model, tmp_path / "again", "--prompt-cache", str(cache), "--prompt-cache-size", "64M")  # a restart
    try:
        r = srv.client().chat.completions.create(model="m", messages=second, max_tokens=4, temperature=0)
        n = _turn_start(model, second)
        assert r.usage.prompt_tokens_details.cached_tokens == n and r.usage.prompt_tokens == len(
            template_ids(model, second))
        text = srv.get("/metrics")[1].decode()
        assert "mbolt_prompt_cache_restores_total 1.0" in text and f"mbolt_prompt_cached_tokens_total {n}.0" in text
        c = anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0)
        third = [{"role": "user", "content": "And four animals?"}]
        msg = c.messages.create(model="m", system=SYS, messages=third, max_tokens=4)
        total = c.messages.count_tokens(model="m", system=SYS, messages=third).input_tokens
        a, b = template_ids(model, second), template_ids(model, _chat(SYS, "And four animals?"))
        held = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the slot holds the last prompt
        assert msg.usage.cache_read_input_tokens == held
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == total
        with c.messages.stream(model="m", system=SYS, messages=third, max_tokens=4) as s:
            streamed = s.get_final_message()
        assert streamed.usage.cache_read_input_tokens > 0
        assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == total
    finally:
        err = srv.stop()
    assert "Traceback" not in err, err


def test_prompt_cache_size_needs_the_directory(model):
    import sys

    r = subprocess.run([sys.executable, "-m", "mbolt", "serve", str(model), "--prompt-cache-size", "1G"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--prompt-cache-size needs --prompt-cache" in r.stderr
    assert "Traceback" not in r.stderr


TINY = dict(n_layers=4, n_experts=8, n_used=2, hidden=64, expert_ff=32, n_heads=4, n_kv_heads=2, head_dim=16)
TINY_FAMILY = {"olmoe": dict(n_kv_heads=4), "deepseek2": dict(n_kv_heads=1), "gpt-oss": dict(sliding_window=16)}


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "mixtral", "qwen2moe", "glm4moe", "deepseek2", "gpt-oss",
                                  "qwen3next"])
def test_kv_bytes_per_token_is_llama_cpps_state_size(arch, tmp_path):
    """The formula behind docs/serve.md's table against llama.cpp's own per-sequence state of a
    synthetic model of the family: the state of 96 tokens less that of 64, per token (past the
    sliding window of gpt-oss)."""
    from mbolt.synth.synth import SynthConfig, write_synth
    from mbolt.runtime.runner import LlamaRunner
    from mbolt.serve.kv_size import kv_bytes_per_token

    cfg = SynthConfig(arch=arch, **{**TINY, **TINY_FAMILY.get(arch, {})})
    write_synth(tmp_path / "m.gguf", cfg)
    with LlamaRunner(tmp_path / "m.gguf", n_ctx=256, f32_kv=False, capture=False) as r:
        sizes = []
        for n in (64, 96):
            r.reset()
            r.eval(list(range(1, n + 1)))
            sizes.append(r.L.llama_state_seq_get_size(r.ctx, 0))
    assert (sizes[1] - sizes[0]) / 32 == kv_bytes_per_token(cfg)


def test_the_docs_table_of_kv_bytes_per_token():
    import re

    from mbolt.serve.kv_size import family_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    rows = [(m[0], m[1], int(m[2]), int(m[3].replace(",", "")))
            for m in re.findall(r"^\| `([\w-]+)` \| ([\w.-]+) \| (\d+) \| ([\d,]+) \|", text, re.M)]
    assert rows == family_table()


def test_mbolt_chat_restores_its_prefix_after_a_restart(model, tmp_path):
    """Two `mbolt chat` sessions with one system prompt: the second evaluates only its question."""
    import re
    import sys

    def chat(question: str) -> str:
        p = subprocess.run([sys.executable, "-m", "mbolt", "chat", str(model), "--ram", "2G", "-c", "1024", "--temp",
                            "0", "--system", SYS, "--prompt-cache", str(tmp_path / "cache")],
                           input=f"{question}\n/exit\n", capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COLUMNS": "200"})
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("[") and "tok/s" in ln]
        return line

    first = chat("Name three colours.")
    assert f"prompt {len(template_ids(model, _chat(SYS, 'Name three colours.')))} new tokens" in first
    assert len(_files(tmp_path / "cache")) == 1
    second = _chat(SYS, "What is two plus two?")
    line = chat("What is two plus two?")
    n = int(re.search(r"prompt (\d+) new tokens", line).group(1))
    assert n == len(template_ids(model, second)) - _turn_start(model, second)


def test_a_sliding_window_familys_state_is_kept_whole(tmp_path):
    """gpt-oss (a sliding-window cache beside the full one): its state is not one stream's block, so
    the file keeps it whole, for a server of as many slots; restored into the other slot, the next
    token's logits are the saving slot's going on, bit for bit."""
    from mbolt.synth.synth import SynthConfig, write_synth
    from mbolt.serve.prefixes import reuse

    path = tmp_path / "oss.gguf"
    write_synth(path, SynthConfig(arch="gpt-oss", **{**TINY, **TINY_FAMILY["gpt-oss"]}))
    ids = [(7 * i) % 200 + 10 for i in range(60)]
    cache = tmp_path / "cache"
    cache.mkdir()
    with Open(path, cache, parallel=2) as o:
        assert o.cache.layout["streams"] == 2
        going_on = o.save_prefix(ids, 40)
        d = o.loaded.driver
        d.forget(0)
        got = reuse(d, 1, ids, o.cache, set())
        assert (got.source, got.cached) == ("disk", 40)
        restored = d.runner.eval(got.todo, seq=1)
    np.testing.assert_array_equal(restored, going_on)
    with Open(path, cache) as o:  # one slot: another layout
        assert reuse(o.loaded.driver, 0, ids, o.cache, set()).source == "none"
        assert o.cache.skipped == {"layout": 1} and "streams" in o.lines[0]


def test_a_killed_writers_temporary_file_is_removed(tmp_path):
    from mbolt.serve.prompt_cache import PromptCache

    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f".abc-20.kv.{dead.pid}.x1y2.part"
    live = tmp_path / f".abc-20.kv.{os.getpid()}.z3w4.part"  # a writer still at work: left alone
    for p in (gone, live):
        p.write_bytes(b"half a state")
    PromptCache(tmp_path, 1 << 20, {"model": "x"}).close()
    assert not gone.exists() and live.exists()


def test_a_state_saved_from_a_second_slot_loads_into_a_server_of_one(model, tmp_path):
    """The other way round: saved from slot 1 of 2 (its block between an empty stream before it),
    loaded into the one slot of a restarted server: the saving slot's logits, bit for bit."""
    from mbolt.serve.prefixes import reuse

    ids = template_ids(model, _chat(SYS, "Name three colours."))
    with Open(model, tmp_path, parallel=2) as o:
        going_on = o.save_prefix(ids, 50, seq=1)
    with Open(model, tmp_path) as o:
        d = o.loaded.driver
        got = reuse(d, 0, ids, o.cache, set())
        assert (got.source, got.cached) == ("disk", 50) and not o.lines
        restored = d.runner.eval(got.todo, seq=0)
    np.testing.assert_array_equal(restored, going_on)
