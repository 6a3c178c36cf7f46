"""The `Serve` panel: mbolt serve (an OpenAI-compatible server) and mbolt chat (a terminal chat),
both on the streaming runtime."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from mbolt.cli.common import (console, ctx_size_option, err_console, output, ram_option, threads_option,
                               user_errors)
from mbolt.core.errors import MboltError

_RAM = ram_option()
_CTX = ctx_size_option(then="; its KV cache is counted in the budget.")
_UB = typer.Option(None, "--ubatch-size", "-ub", min=1, help="Tokens per prompt pass (the runtime may take fewer "
                   "to fit the budget). Default: 2048 for the runtime with one slot, llama.cpp's 512 for --plain "
                   "and for several slots (a pass holds up the running replies).")
_THREADS = threads_option()
_PLAIN = typer.Option(False, "--plain", help="Plain llama.cpp instead of the runtime (the file mapped, repacking "
                      "off, no callback): what the runtime is measured against.")


_PARALLEL = typer.Option(None, "--parallel", "-np", min=1, help="Conversations decoded together (llama-server's "
                         "slots), each with its own KV cache of --ctx-size tokens. Default: from the budget (up to 4 "
                         "whose KV caches take at most an eighth of it and whose experts of two steps each the "
                         "cache holds; 1 when only one fits).")
_PROMPT_CACHE = typer.Option(None, "--prompt-cache", help="A directory for the KV states of prompt prefixes (up to "
                             "the last user turn: an agent's system prompt and tools, a chat's history), restored into "
                             "any request that starts with one, across slots and restarts (serve.prompt_cache).")
_PROMPT_CACHE_SIZE = typer.Option(None, "--prompt-cache-size", help="What the --prompt-cache directory may hold (e.g. "
                                  "8G); the least recently used files go first. Default: 10% of the free space on its "
                                  "filesystem at start, at most 32G.")


def _prompt_cache(directory: Path | None, size: str | None, loaded):
    """The prompt cache the options ask for (None without --prompt-cache)."""
    if directory is None:
        return None
    from mbolt.core.memlimit import parse_size
    from mbolt.serve.prompt_cache import PromptCache, default_size, layout_of

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MboltError(f"{directory}: cannot create the --prompt-cache directory: {e.strerror or e}") from None
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise MboltError(f"{directory}: --prompt-cache is not a writable directory")
    n = parse_size(size, "--prompt-cache-size") if size is not None else default_size(directory)
    cache = PromptCache(directory, n, layout_of(loaded.driver),
                        say=lambda line: err_console.print(line, markup=False, highlight=False, soft_wrap=True))
    files = cache.scan()
    err_console.print(f"[dim]prompt cache {directory}: {n / 2**30:.2f} GiB; {len(files)} file"
                      f"{'s' if len(files) != 1 else ''} of this model[/]", highlight=False)
    return cache


def _load(model: Path, ram, ctx_size, ubatch, threads, plain, parallel=None, watchers=()):
    from rich.status import Status

    from mbolt.serve.model import open_model

    with Status(f"loading {model.name}", console=err_console, spinner="dots"):
        loaded = open_model(model, ram=ram, n_ctx=ctx_size, n_ubatch=ubatch, n_threads=threads or None, plain=plain,
                            parallel=parallel, watchers=watchers)
    slots = f"{loaded.driver.n_seq} slot{'s' if loaded.driver.n_seq > 1 else ''} of {loaded.n_ctx} tokens"
    if not loaded.streaming:
        err_console.print(f"[dim]plain llama.cpp: the file mapped, repacking off; {slots}[/]", highlight=False)
    else:
        err_console.print(f"[dim]budget {loaded.budget / 2**30:.2f} GiB ({loaded.budget_from}): {slots}; "
                          f"{loaded.driver.describe_budget()}[/]", highlight=False)
    return loaded


@user_errors
def serve_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF (any shard of a split set)."),
    ram: str = _RAM,
    ctx_size: int = _CTX,
    ubatch: int = _UB,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (127.0.0.1: this machine only)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on."),
    threads: int = _THREADS,
    api_key: str = typer.Option(None, "--api-key", envvar="MBOLT_API_KEY", help="Require `Authorization: Bearer "
                                "KEY` on every endpoint but / and /health (also from MBOLT_API_KEY)."),
    alias: str = typer.Option(None, "--alias", help="The model name /v1/models reports (default: the file's name); "
                              "requests may name any model."),
    queue_size: int = typer.Option(8, "--queue", min=0, help="Requests that may wait while every slot is busy; "
                                   "beyond it a request gets 503 with Retry-After."),
    record: Path = typer.Option(None, "--record-routing", help="Record the routing of the traffic served into this "
                                ".mbtrace (rewritten atomically after every request: readable at any time; `mbolt "
                                "plan` takes it)."),
    record_max: int = typer.Option(100_000, "--record-max-tokens", min=1, help="Record at most this many tokens."),
    plain: bool = _PLAIN,
    parallel: int = _PARALLEL,
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --record-routing trace."),
    prompt_cache: Path = _PROMPT_CACHE,
    prompt_cache_size: str = _PROMPT_CACHE_SIZE,
):
    """Serve a model larger than RAM with an OpenAI-compatible API (chat and completions, streamed or not),
    /metrics and a chat page at /."""
    import uvicorn

    from mbolt.core.moe_map import moe_map
    from mbolt.serve.app import create_app
    from mbolt.serve.scheduler import Scheduler

    recorder = None
    if record is not None:
        from mbolt.serve.record import RoutingRecorder

        mm = moe_map(model, kernel_ok=True)  # a kernel-layout file's routing is its model's
        output(record, "mbtrace", inputs=[model], force=force, what="trace",
               protected=(mm.fingerprint, mm.source_fingerprint))
        recorder = RoutingRecorder(record, mm, record_max)
    if prompt_cache is None and prompt_cache_size is not None:
        raise MboltError("--prompt-cache-size needs --prompt-cache DIR")
    loaded = _load(model, ram, ctx_size, ubatch, threads, plain, parallel, watchers=[recorder] if recorder else ())
    name = alias or Path(model).name
    try:
        cache = _prompt_cache(prompt_cache, prompt_cache_size, loaded)
    except BaseException:
        loaded.close()
        raise
    scheduler = Scheduler(loaded, max_queue=queue_size, recorder=recorder, name=name, prompt_cache=cache)
    if recorder is not None:
        recorder.flush()  # the file exists (empty) from the start
    try:
        app = create_app(scheduler, api_key=api_key or None, model_name=name)
        shown = f"[{host}]" if ":" in host else host
        console.print(f"serving {name} at http://{shown}:{port}  (OpenAI API: http://{shown}:{port}/v1, chat page: "
                      f"http://{shown}:{port}/){'; API key required' if api_key else ''}", highlight=False)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    except OSError as e:
        raise MboltError(f"{host}:{port}: cannot listen: {e.strerror or e}") from None
    finally:
        scheduler.close()
        loaded.close()


@user_errors
def chat_cmd(
    model: Path = typer.Argument(..., help="A MoE GGUF with a chat template (tokenizer.chat_template)."),
    ram: str = _RAM,
    ctx_size: int = _CTX,
    ubatch: int = _UB,
    threads: int = _THREADS,
    system: str = typer.Option(None, "--system", "-sys", help="A system prompt."),
    temperature: float = typer.Option(0.8, "--temp", min=0.0, max=2.0, help="Sampling temperature (0: greedy)."),
    seed: int = typer.Option(None, "--seed", min=0, help="Sampling seed."),
    plain: bool = _PLAIN,
    prompt_cache: Path = _PROMPT_CACHE,
    prompt_cache_size: str = _PROMPT_CACHE_SIZE,
):
    """Chat with a model larger than RAM in the terminal (Ctrl-C stops a reply, /exit ends)."""
    import sys

    from gguf import Keys

    from mbolt.core.gguf_set import open_model_header
    from mbolt.serve.chat import chat_loop
    from mbolt.serve.scheduler import Scheduler

    if not open_model_header(model).get(Keys.Tokenizer.CHAT_TEMPLATE):
        raise MboltError(f"{model}: the GGUF has no tokenizer.chat_template: chat needs one (mbolt generate "
                         "takes plain text)")
    if prompt_cache is None and prompt_cache_size is not None:
        raise MboltError("--prompt-cache-size needs --prompt-cache DIR")
    loaded = _load(model, ram, ctx_size, ubatch, threads, plain, parallel=1)
    try:
        cache = _prompt_cache(prompt_cache, prompt_cache_size, loaded)
    except BaseException:
        loaded.close()
        raise
    scheduler = Scheduler(loaded, max_queue=1, name=Path(model).name, prompt_cache=cache)
    try:
        err_console.print("[dim]/exit or Ctrl-D ends; Ctrl-C stops a reply[/]")
        sampling = {"temperature": temperature, **({"seed": seed} if seed is not None else {})}
        chat_loop(scheduler, system=system, sampling=sampling, read=input if sys.stdin.isatty() else _line_reader(),
                  write=lambda t: (sys.stdout.write(t), sys.stdout.flush()),
                  note=lambda t: err_console.print(f"[dim]{t}[/]", highlight=False))
    finally:
        scheduler.close()
        loaded.close()


def _line_reader():
    """input() for a pipe: no prompt echo into the output stream."""
    import sys

    def read(prompt: str) -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    return read

