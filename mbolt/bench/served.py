"""A `mbolt serve` process under test and its client (the official openai client), shared by
scripts/bench_serve.py's workloads (session, concurrency, agent: bench.agent)."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from mbolt.bench.memlimit import paths
from mbolt.bench.prereg import gate_run
from mbolt.core.errors import MboltError
from mbolt.core.memlimit import MemoryGroup

ROOT = Path(__file__).resolve().parents[2]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server process (in a group, or not) and its client."""

    def __init__(self, model: Path, plain: bool, group: MemoryGroup | None, queue: int = 8, ubatch: int = 0,
                 parallel: int = 1, ctx: int = 4096, extra: tuple[str, ...] = ()):
        self.model = model
        self.port = _port()
        argv = [sys.executable, "-m", "mbolt", "serve", str(model), "--port", str(self.port), "-c", str(ctx),
                "--queue", str(queue), "-np", str(parallel)] + (["--plain"] if plain else []) \
            + (["-ub", str(ubatch)] if ubatch else []) + list(extra)
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.proc = group.popen(argv, **kw) if group is not None else subprocess.Popen(argv, **kw)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-", max_retries=0,
                                    timeout=3600)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server ended: {''.join(self.err)[-2000:]}")
            try:
                import urllib.request

                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        self.load_s = time.time() - t0

    def metrics(self) -> dict:
        import urllib.request

        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats").read())

    def turn(self, prompt: list[int], n: int, seed: int, on_first: threading.Event | None = None) -> dict:
        """One streamed completion, timed by the client: TTFT is the request to the first streamed
        event that carries a token (a choice; its text may be empty while a UTF-8 character is
        still incomplete), decode tok/s the tokens after the first over the wall time after it.
        The token count is the server's usage (the reply must be exactly `n`: `ignore_eos`, as
        llama-server's benchmarks ask, so that a sampled end-of-generation token does not end it)."""
        t0 = time.perf_counter()
        first, text, usage = None, [], None
        for ch in self.client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=1.0,
                                                 top_p=1.0, seed=seed, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"top_k": 0, "min_p": 0.0, "ignore_eos": True}):
            if ch.choices and first is None:
                first = time.perf_counter() - t0
                if on_first is not None:
                    on_first.set()
            if ch.choices and ch.choices[0].text:
                text.append(ch.choices[0].text)
            if ch.usage:
                usage = ch.usage
        t_end = time.perf_counter()
        wall = t_end - t0
        n_out = usage.completion_tokens if usage else None
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return {"t_start": t0, "t_first": t0 + first if first is not None else None, "t_end": t_end,
                "prompt_tokens": len(prompt), "ttft_s": first,
                "cached_tokens": getattr(details, "cached_tokens", None),  # the server's: not evaluated "ttft_source": "client: first streamed token event",
                "wall_s": wall, "completion_tokens": n_out, "max_tokens": n,
                "tokens_exact": n_out == n, "overrun": (n_out - n) if n_out is not None and n_out > n else 0,
                "decode_tokens_per_s": (n_out - 1) / (wall - first) if n_out and n_out > 1 and first is not None
                and wall > first else None,
                "text_sha256": hashlib.sha256("".join(text).encode()).hexdigest(), "text": "".join(text)}

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.2)
        return "".join(self.err)


def in_parallel(client, n: int) -> float:
    """client(0..n-1), each on a thread of its own, all started at once; the wall seconds until the
    last ends."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.time() - t0


def log_errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "Traceback" in ln or ln.lower().startswith("error")]


def gate(prereg: Path, goal_keys, dst: Path, dry_run: bool):
    """The pre-registration checked (bench.prereg) before anything runs: one error line otherwise."""
    try:
        pr, lock = gate_run(prereg, ROOT, goal_keys, dst, count_run=not dry_run)
    except MboltError as e:
        raise SystemExit(f"error: {e}") from None
    return pr, lock


def bench_model(name: str) -> tuple[Path, int, int]:
    """The benchmark model made by bench_memlimit.py prepare, its size and the 40% budget."""
    model = paths(name)["stock"]
    if not model.exists():
        raise SystemExit(f"{model}: run `python scripts/bench_memlimit.py prepare --models {name}` first")
    size = model.stat().st_size
    return model, size, int(0.4 * size)
