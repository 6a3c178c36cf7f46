"""`mbolt serve` driven by the official `openai` client (issue 27), and `mbolt chat`.

The model carries llama.cpp's Qwen2 test vocabulary (tests/.vocabs, fetched from the release's
source), whose GGUF has a chat template. The server runs as a real process on a free port, with
an API key, a queue of one and --record-routing. What is checked comes from outside the server:
the openai client's parsing of every response (streamed and not), llama.cpp's own greedy tokens
through mbolt's runtime driven directly (open_driver) for the same prompt templated by jinja2 in
the test, HTTP status codes, the Prometheus text, the recorded trace read back and planned, and a
real headless Chromium for the page.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import EXPERT_GAIN, IN_CI, needs_llama, require_vocab
from mbolt.synth.synth import SynthConfig, write_synth

pytestmark = needs_llama
KEY = "test-key-123"
VOCAB = Path(__file__).parent / ".vocabs" / "ggml-vocab-qwen2.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("serve") / "chat.gguf", require_vocab(VOCAB))


CHAT_MODEL = SynthConfig(arch="qwen3moe", n_layers=2, n_experts=16, n_used=4, hidden=64, expert_ff=64, n_heads=4,
                         n_kv_heads=2, head_dim=16, expert_type="Q8_0", dense_type="F16", seed=7,
                         expert_gain=EXPERT_GAIN)


def write_chat_model(path: Path, vocab: Path) -> Path:
    """A tiny random-weight qwen3moe with a real vocabulary (and the chat template it carries)."""
    write_synth(path, dataclasses.replace(CHAT_MODEL, vocab=str(vocab)))
    return path


class Server:
    def __init__(self, model, tmp, *extra):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.trace = tmp / "served.mbtrace"
        self.proc = subprocess.Popen([sys.executable, "-m", "mbolt", "serve", str(model), "--ram", "2G", "-c", "1024",
                                      "--port", str(self.port), "--api-key", KEY, "--queue", "1", "--parallel", "1", "--record-routing",
                                      str(self.trace), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.wait_until_up()

    def wait_until_up(self, timeout: float = 120):
        """Until /health answers 200; the server's stderr if it ends first."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server ended: {self.proc.stderr.read()}")
            try:
                if self.get("/health", key=None)[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("server did not come up")

    def request(self, method, path, body: bytes | None = None, key: str | None = KEY, timeout=120):
        req = urllib.request.Request(self.base + path, data=body, method=method,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}

    def get(self, path, key: str | None = KEY):
        return self.request("GET", path, key=key)

    def stats(self) -> dict:
        return json.loads(self.get("/stats")[1])

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, **kw)

    def stop(self):
        self.proc.terminate()
        try:
            out, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return err


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("served"))
    yield s
    err = s.stop()
    assert "Traceback" not in err, err  # no request killed a handler or the server


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def llama_tokens(model, text: str) -> list[int]:
    """`text` tokenized by llama.cpp itself (the model's vocabulary only, special tokens parsed):
    independent of the server's code."""
    import llama_cpp

    from mbolt.runtime.runner import LlamaRunner

    raw = text.encode()
    with LlamaRunner(model, vocab_only=True) as v:
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(v.vocab, raw, len(raw), buf, len(buf), False, True)
        return list(buf[:n])


def template_ids(model, messages, generation: bool = True) -> list[int]:
    """The conversation through the GGUF's own template, rendered here with jinja2 and tokenized by
    llama.cpp (`llama_tokens`): independent of the server's code."""
    import jinja2
    from gguf import GGUFReader

    r = GGUFReader(str(model))
    f = r.fields["tokenizer.chat_template"]
    template = bytes(f.parts[f.data[0]]).decode()
    text = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=generation)
    return llama_tokens(model, text)


def test_chat_at_temperature_0_gives_the_runtimes_greedy_tokens(server, model):
    from mbolt.runtime.driver import open_driver

    r = server.client().chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=12, temperature=0,
                                                extra_body={"return_tokens": True})
    d = r.model_dump()
    ids = template_ids(model, MESSAGES)
    assert d["prompt_tokens"] == ids
    got = d["choices"][0]["tokens"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(got) > 0
    with open_driver(model, budget=2 << 30, qd=4, asynchronous=True, n_ctx=1024) as s:
        s.make_cold()
        want = s.generate([ids], 12).generated[0]
    assert got == want[:len(got)]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_and_completions_match_unstreamed(server):
    c = server.client()
    whole = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=10, temperature=0)
    parts, usage, roles = [], None, []
    for ch in c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            roles.append(choice.delta.role)
            parts.append(choice.delta.content or "")
    assert "".join(parts) == whole.choices[0].message.content and "assistant" in roles
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    text = c.completions.create(model="y", prompt="Once upon a time", max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="y", prompt="Once upon a time",
                                                                          max_tokens=8, temperature=0, stream=True)
                       if ch.choices)
    assert streamed == text.choices[0].text and text.usage.completion_tokens == 8
    assert [m.id for m in c.models.list().data] == ["chat.gguf"]


def test_sampling_options_and_stop(server):
    c = server.client()
    a = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, temperature=0.9, top_p=0.9, seed=5,
                                  extra_body={"top_k": 20, "min_p": 0.1, "repeat_penalty": 1.1})
    b = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, temperature=0.9, top_p=0.9, seed=5,
                                  extra_body={"top_k": 20, "min_p": 0.1, "repeat_penalty": 1.1})
    assert a.choices[0].message.content == b.choices[0].message.content  # the same seed, the same tokens
    text = a.choices[0].message.content
    if len(text) > 3:
        cut = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, temperature=0.9, top_p=0.9,
                                        seed=5, stop=[text[2:4]],
                                        extra_body={"top_k": 20, "min_p": 0.1, "repeat_penalty": 1.1})
        assert text[2:4] not in cut.choices[0].message.content and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    (b"{not json", None), (b"[1, 2]", None), (b'{"model": "m"}', "messages"), (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": 3}', "stop"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
])
def test_bad_requests_are_4xx_and_change_nothing(server, body, param):
    before = server.stats()["requests"]
    status, raw, _ = server.request("POST", "/v1/chat/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert server.stats()["requests"] == before
    assert server.get("/health")[0] == 200


def test_bad_requests_through_the_client(server):
    import openai

    c = server.client()
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="m", prompt="x" * 50, max_tokens=5000)
    assert server.request("POST", "/v1/completions", b'{"prompt": ""}')[0] == 400
    assert server.request("GET", "/v1/nothing")[0] == 404


def test_api_key(server):
    assert server.request("GET", "/v1/models", key=None)[0] == 401
    assert server.request("GET", "/v1/models", key="wrong")[0] == 401
    assert server.request("POST", "/v1/chat/completions", b"{}", key=None)[0] == 401
    assert server.request("GET", "/metrics", key=None)[0] == 401
    assert server.request("GET", "/health", key=None)[0] == 200
    assert server.request("GET", "/", key=None)[0] == 200


def _metric(server, name) -> float:
    text = server.get("/metrics")[1].decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_metrics_move_with_traffic(server):
    names = ["mbolt_decode_tokens_total", "mbolt_prompt_tokens_total", "mbolt_requests_total",
             "mbolt_expert_cache_misses_total", "mbolt_decode_seconds_total"]
    before = {n: _metric(server, n) for n in names}
    assert _metric(server, "mbolt_budget_bytes") == 2 << 30 and _metric(server, "mbolt_expert_slots") >= 4
    assert _metric(server, "mbolt_dense_resident_bytes") > 0 and _metric(server, "mbolt_queue_length") == 0
    r = server.client().completions.create(model="m", prompt="The weather today", max_tokens=6, temperature=0)
    after = {n: _metric(server, n) for n in names}
    assert after["mbolt_decode_tokens_total"] - before["mbolt_decode_tokens_total"] == r.usage.completion_tokens - 1
    assert after["mbolt_prompt_tokens_total"] - before["mbolt_prompt_tokens_total"] >= 1
    assert after["mbolt_requests_total"] == before["mbolt_requests_total"] + 1
    assert after["mbolt_decode_seconds_total"] > before["mbolt_decode_seconds_total"]


def test_a_client_that_goes_away_stops_its_work(server):
    """A streamed request with room for 900 tokens, dropped after two chunks: the server stops it
    at its next token (decode tokens stop growing, well short of 900) and serves the next request."""
    before = server.stats()["decode_tokens"]
    c = server.client()
    stream = c.completions.create(model="m", prompt="Count: one two three", max_tokens=900, temperature=0.8,
                                  stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline and server.stats()["queue_length"] + (server.stats()["decode_tokens"] < 0) > 0:
        time.sleep(0.1)
    time.sleep(1.0)
    a = server.stats()["decode_tokens"]
    time.sleep(1.0)
    assert server.stats()["decode_tokens"] == a < before + 900  # nothing runs any more
    ok = c.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_queue_bound_refuses_with_503_and_retry_after(server):
    """Queue of one: while one long request runs and one waits, a third gets 503 with Retry-After;
    every request is answered or refused, none is lost."""
    results = []

    def long_request():
        results.append(server.request("POST", "/v1/completions", json.dumps(
            {"prompt": "Tell a long story", "max_tokens": 900, "temperature": 0.8}).encode(), timeout=900))

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.5)
    deadline = time.time() + 10
    while server.stats()["queue_length"] < 1 and time.time() < deadline:
        time.sleep(0.05)
    status, raw, headers = server.request("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    for t in threads:
        t.join(timeout=900)
    assert status == 503, (status, raw, server.stats())
    assert int(headers["retry-after"]) > 0 and json.loads(raw)["error"]["code"] == "queue_full"
    assert sorted(s for s, _, _ in results) == [200, 200]


def test_recorded_routing_is_a_trace_plan_takes(server, model, tmp_path):
    from mbolt.core.mbtrace import read_trace

    server.client().chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, temperature=0)
    t = read_trace(server.trace)  # readable while the server runs
    assert t.n_tokens > 0 and t.k == 4 and t.n_experts == 16 and (t.phase == 1).any() and (t.phase == 0).any()
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "mbolt", "plan", str(server.trace), "--model", str(model), "-o",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["n_experts"] == 16


@pytest.mark.skipif(not IN_CI and (shutil.which("chromium") is None or shutil.which("chromedriver") is None),
                    reason="Debian's chromium and chromium-driver are needed (CI installs them)")
def test_the_page_in_a_real_browser(server):
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage"):
        opts.add_argument(a)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))
    try:
        driver.get(server.base + "/")
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "input").send_keys("Hello there")
        driver.find_element(By.ID, "send").click()
        wait = WebDriverWait(driver, 120)
        # the reply streams in (it may run to the end of the context: no max_tokens), and the
        # numbers beside it come alive while it does
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text.strip()) > 10)
        wait.until(lambda d: d.find_element(By.ID, "s-tps").text not in ("", "\u2013")
                   and d.find_element(By.ID, "s-mb").text not in ("", "\u2013"))
        assert driver.find_element(By.ID, "s-budget").text == "2.00 GiB"
        assert driver.find_element(By.ID, "s-mode").text == "mbolt runtime"
        assert float(driver.find_element(By.ID, "s-tps").text) > 0
        assert driver.find_element(By.ID, "s-hit").text.endswith("%")
        assert float(driver.find_element(By.ID, "s-mb").text) >= 0
        assert driver.find_element(By.ID, "s-slots").text.isdigit()
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg.err")
    finally:
        driver.quit()


def test_chat_in_the_terminal(model):
    """`mbolt chat` through a pipe: two turns, /exit; a reply each and a line of numbers each."""
    p = subprocess.run([sys.executable, "-m", "mbolt", "chat", str(model), "--ram", "2G", "-c", "1024", "--temp", "0"],
                       input="Hello\nAnd again?\n/exit\n", capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("[")]
    assert len(lines) == 2 and all("tok/s" in ln and "hit rate" in ln for ln in lines), p.stderr
    assert p.stdout.strip()


PROMPTS = ["The weather today", "Once upon a time", "List the planets:", "def fibonacci(n):"]


def test_four_clients_at_once_get_what_each_gets_alone(model, tmp_path):
    """--parallel 4: four clients at once are decoded together (steps of several rows, a union of
    experts per layer smaller than rows x k) and each gets the greedy ids it gets alone. The
    weights are Q8_0 and F16: llama.cpp's CPU kernels compute each row of a batch with the same
    dot products as a batch of one (activations quantized per row, accumulation per row), so the
    tolerance is none: the same ids. /metrics shows the slots and the union."""
    srv = Server(model, tmp_path, "--parallel", "4", "--queue", "4")
    try:
        c = srv.client()

        def ask(prompt):
            r = c.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"return_tokens": True})
            return json.loads(r.model_dump_json())["choices"][0]["tokens"]

        alone = [ask(p) for p in PROMPTS]
        steps0, rows0 = srv.stats()["decode_steps"], srv.stats()["rows_per_step"] * srv.stats()["decode_steps"]
        together: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(PROMPTS[i]))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        s = srv.stats()
        text = srv.get("/metrics")[1].decode()
    finally:
        err = srv.stop()
    assert "Traceback" not in err, err
    assert [together[i] for i in range(4)] == alone
    assert len({tuple(a) for a in alone}) == 4  # four different replies: a shared one would prove nothing
    rows_together = s["rows_per_step"] * s["decode_steps"] - rows0
    assert rows_together / (s["decode_steps"] - steps0) > 2  # most steps carried several conversations
    assert s["parallel"] == 4 and len(s["slots"]) == 4
    assert "mbolt_slots 4.0" in text and 'mbolt_slot_tokens_per_second{slot="3"}' in text
    union = float(next(line.split()[1] for line in text.splitlines() if line.startswith("mbolt_expert_union_per_step ")))
    assert union > 4  # k=4 per step alone: the batched steps read a union of several rows' experts


def test_a_newcomers_prompt_passes_carry_the_replies_under_way(model, tmp_path):
    """Continuous batching across a prompt: while a newcomer's prompt runs in passes (-ub 8: a
    long prompt is many), the reply under way gets a decode row in each pass (llama-server's mixed
    batch) instead of waiting for the whole prompt. Both get what each gets alone (the same
    kernels per row: no tolerance), and the server counts the mixed passes."""
    srv = Server(model, tmp_path, "--parallel", "2", "--queue", "2", "-ub", "8")
    long_prompt = "Tell me about the sea and the ships on it. " * 14
    try:
        c = srv.client()

        def reply_text(prompt):  # streamed: the first chunk says the prompt is done
            return "".join(ch.choices[0].text for ch in c.completions.create(
                model="m", prompt=prompt, max_tokens=120, temperature=0, stream=True) if ch.choices)

        def newcomer():
            r = c.completions.create(model="m", prompt=long_prompt, max_tokens=8, temperature=0,
                                     extra_body={"return_tokens": True})
            return json.loads(r.model_dump_json())

        first_alone, newcomer_alone = reply_text(PROMPTS[1]), newcomer()
        passes0 = srv.stats()["mixed_passes"]
        assert passes0 == 0  # one at a time: no pass had a reply beside it
        got: dict[str, object] = {}
        decoding = threading.Event()

        def first():
            parts = []
            for ch in c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=120, temperature=0, stream=True):
                if ch.choices:
                    parts.append(ch.choices[0].text)
                    decoding.set()
            got["first"] = "".join(parts)

        t = threading.Thread(target=first)
        t.start()
        assert decoding.wait(timeout=120)
        got["newcomer"] = newcomer()
        t.join(timeout=300)
        s = srv.stats()
    finally:
        err = srv.stop()
    assert "Traceback" not in err, err
    assert len(newcomer_alone["prompt_tokens"]) > 8 * 6  # several passes of 8
    assert got["first"] == first_alone and len(first_alone) > 0
    assert got["newcomer"]["choices"][0]["tokens"] == newcomer_alone["choices"][0]["tokens"]
    assert s["mixed_passes"] - passes0 >= 2  # the reply under way rode in the newcomer's passes


def test_ignore_eos_runs_a_reply_to_max_tokens(tmp_path):
    """llama-server's `ignore_eos`: a reply that sampling ends early at the end-of-generation token
    runs to max_tokens with it (the benchmarks' 256 tokens per reply). The model has the synthetic
    byte vocabulary (262 tokens, <|eos|> among them), so at temperature 2 a seed whose reply ends
    early is found among the first few; the eos id the sampler bans is checked against gguf-py."""
    import gguf

    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.sampling import eog_tokens

    path = tmp_path / "bytes.gguf"
    write_synth(path, SynthConfig(arch="qwen3moe", n_layers=2, n_experts=16, n_used=4, hidden=64, expert_ff=64,
                                  n_heads=4, n_kv_heads=2, head_dim=16, expert_type="Q8_0", dense_type="F16", seed=7))
    eos = int(gguf.GGUFReader(path).fields["tokenizer.ggml.eos_token_id"].contents())
    with open_driver(str(path), reads=False) as s:
        assert eos in eog_tokens(s.runner.L, s.runner.vocab) and len(eog_tokens(s.runner.L, s.runner.vocab)) < 4
    srv = Server(path, tmp_path)
    try:
        c = srv.client()
        loose = dict(model="m", prompt="The castle is", max_tokens=400, temperature=2.0, top_p=1.0)
        extra = {"top_k": 0, "min_p": 0.0}
        for seed in range(40):
            early = c.completions.create(seed=seed, extra_body=extra, **loose)
            if early.choices[0].finish_reason == "stop":
                break
        assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < 400, "no seed ended early"
        full = c.completions.create(seed=seed, extra_body={**extra, "ignore_eos": True}, **loose)
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 400
        status, body, _ = srv.request("POST", "/v1/completions",
                                      json.dumps({"prompt": "x", "ignore_eos": "yes"}).encode())
        assert status == 400 and json.loads(body)["error"]["param"] == "ignore_eos"
        status, body, _ = srv.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True,
             "response_format": {"type": "json_object"}}).encode())
        assert status == 400 and json.loads(body)["error"]["param"] == "ignore_eos", body
    finally:
        err = srv.stop()
    assert "Traceback" not in err, err
