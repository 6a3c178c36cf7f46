"""One path from the command to the drive (issues 33, 56): `generate --stream`, `chat`, `serve`
and `ab` run the runtime's one driver, so the same prompt under the same --ram gives the same
greedy tokens and the same runtime counters (reads, bytes, hits) from each. Every figure is read
from outside: the JSON `generate` and `ab` print, the server's /stats and the official `openai`
client, the chat's own output in a pipe. Each command is a fresh process, so each starts with the
same cold cache."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import needs_llama
from test_serve import Server, model  # noqa: F401 (the served model fixture)

pytestmark = needs_llama
PROMPT = "The colours of the sea at dawn are"
N = 12


def _mbolt(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "mbolt", *args], input=stdin, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


def test_generate_chat_and_serve_run_the_same_path(model, tmp_path):  # noqa: F811 (the fixture)
    gen = json.loads(_mbolt("generate", str(model), PROMPT, "--engine", "llama.cpp", "--stream", "--ram", "2G",
                            "-c", "512", "-n", str(N), "--json").stdout)
    chat = _mbolt("chat", str(model), "--ram", "2G", "-c", "512", "--temp", "0", stdin="Name three colours.\n/exit\n")
    # ab's decode arm (no --ram: that would run it in a memory cgroup; the tokens do not depend on it)
    (tmp_path / "prompt.txt").write_text(PROMPT + "\n")
    ab = json.loads(subprocess.run(
        [sys.executable, "-m", "mbolt", "ab", str(model), "--decode", "--engine", "llama.cpp", "--prompts",
         str(tmp_path / "prompt.txt"), "--n-prompts", "1", "-n", str(N), "-c", "512", "--rounds", "1", "--no-aa",
         "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=True).stdout)
    srv = Server(model, tmp_path, "-c", "512")  # --ram 2G, --parallel 1 (the fixture's)
    try:
        c = srv.client()
        done = c.completions.create(model="m", prompt=PROMPT, max_tokens=N + 1, temperature=0,
                                    extra_body={"return_tokens": True})
        s = srv.stats()
        reply = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name three colours."}],
                                          max_tokens=256, temperature=0)
    finally:
        srv.stop()
    # the same tokens: N decode steps after the prompt in each (serve's first token comes from the
    # prompt's logits, as generate's first prediction does; its last step's token is not fed)
    served_ids = json.loads(done.model_dump_json())["choices"][0]["tokens"][:N]
    assert served_ids == gen["ids"]
    assert [r["generated"] for r in ab["rounds"]] == [[gen["ids"]]]  # one round of one prompt
    # the same runtime counters for those N steps
    assert (s["cache_hits"], s["cache_misses"]) == (gen["hits"], gen["misses"])
    assert s["decode_read_bytes"] == round(gen["bytes_per_token"] * N)
    # the chat in the terminal replies what the server replies to the same message
    text = reply.choices[0].message.content
    assert text and text.replace("\r\n", "\n").replace("\r", "\n") in chat.stdout  # the pipe's universal newlines
