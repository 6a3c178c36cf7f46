"""The peer's time to first token beside the runtime's (issue 35): ik_llama.cpp's `llama-cli`
evaluates the text the mbolt arms are prompted with and samples one token, cold under the same
memory cgroup (bench.peers.run_cold: the file dropped, the experts' pages dropped again after its
load), or warm (the file in memory, no limit), at a given prompt pass size (`-ub`).

Its time to first token is the "prompt eval time" it prints: every llama_decode of the
prompt (load, tokenizing and sampling excluded), as the mbolt arms' TTFT is the prompt's
llama_decode calls and their reads. The text is the shortest prefix of the mbolt arms' text that
the model's tokenizer makes `prompt_tokens` tokens long (BOS first); llama-cli tokenizes it again
itself, and its count is recorded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mbolt.bench.peers import PeerArm, PeerBuild, aa_of, run_cold
from mbolt.core.errors import MboltError

# main prints it once the model is loaded (and warmed up, where it warms up), before the prompt
PROMPT_MARK = "generate: n_ctx ="
# ik's main prints its own timings ("main: prompt eval time = ..."); llama.cpp's llama_print_timings
# the same line under its name
_PROMPT_EVAL = re.compile(r"(?:main|llama_print_timings): prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?:main|llama_print_timings):\s+eval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")
PROMPT_CTX = 4096  # room for a 2,000-token prompt (main refuses a prompt longer than n_ctx - 4)

FED = ("llama-cli -n 1 --temp 0: the mbolt arms' text, its prefix of {tokens} tokens (BOS first), evaluated in "
       "llama_decode passes of -ub tokens (-b {batch}: one call), one token sampled; timed: its prompt eval time. Cold arms start with --defer-experts (dense weights loaded, no expert page mapped, no "
       "warmup) and their experts' pages dropped once loaded: the mbolt arms' cold start.")


@dataclass(frozen=True)
class PromptArm:
    """An ik configuration (mapped or --prefetch-experts; warm) at a prompt pass size."""

    peer: PeerArm
    n_ubatch: int

    @property
    def name(self) -> str:
        return self.peer.name


def prompt_arms(n_ubatches=(512, 2048), aa: bool = True) -> list[PromptArm]:
    """Under the limit: ik mapped at each pass size (512 is ik's default; A/A of the first) and
    --prefetch-experts (ik's own worker count: its bulk read-ahead is for prompts) at the largest."""
    ub = max(n_ubatches)
    arms = [PromptArm(PeerArm(f"ik-{n}"), n) for n in n_ubatches]
    if aa:
        arms.insert(1, PromptArm(PeerArm(f"ik-{n_ubatches[0]} (A/A)", control_of=f"ik-{n_ubatches[0]}"),
                                 n_ubatches[0]))
    return arms + [PromptArm(PeerArm(f"ik-prefetch-{ub}", prefetch_threads=0), ub)]


def warm_prompt_arms(n_ubatches=(512, 2048)) -> list[PromptArm]:
    return [PromptArm(PeerArm(f"ik-warm-{n}", warm=True), n) for n in n_ubatches]


def cli_argv(build: PeerBuild, arm: PromptArm, model: Path, prompt: Path, n_ctx: int = PROMPT_CTX,
             threads: int = 2) -> list[str]:
    cold = [] if arm.peer.warm else ["--defer-experts"]  # as peers.perplexity_argv: the mbolt arms' start
    batch = max(arm.n_ubatch, 2048)
    return [str(build.cli), "-m", str(model), "-f", str(prompt), "-n", "1", "--temp", "0", "-c", str(n_ctx),
            "-b", str(batch), "-ub", str(arm.n_ubatch), "-t", str(threads), "--no-display-prompt", *cold,
            *arm.peer.flags()]


def parse_prompt_eval(text: str, source: str) -> tuple[float, int]:
    """llama-cli's output -> (prompt eval seconds, prompt tokens), or one line saying what is wrong.
    One token sampled and none decoded after it: an eval line with runs is refused."""
    m = _PROMPT_EVAL.search(text)
    if m is None:
        raise MboltError(f"{source}: not llama-cli output this parser knows (no prompt eval time line)")
    ms, n = float(m[1]), int(m[2])
    if n < 2 or ms <= 0:
        raise MboltError(f"{source}: llama-cli reports a prompt of {n} tokens in {ms} ms: not a prompt evaluated")
    ev = _EVAL.search(text)
    if ev is not None and int(ev[2]) > 1:
        raise MboltError(f"{source}: llama-cli decoded {ev[2]} tokens after the prompt where one sample was asked")
    return ms / 1e3, n


def prompt_text(model: Path, prompt_tokens: int, new_tokens: int = 0, followup: int = 0) -> str:
    """The shortest prefix of the mbolt arms' text (bench.ab.load_prompt_ids, no prompt file) that
    the model's tokenizer makes at least `prompt_tokens` tokens, BOS included."""
    from mbolt.bench.ab import load_prompt_ids
    from mbolt.core.prompts import forced_texts, session_texts
    from mbolt.runtime.runner import LlamaRunner

    ids = load_prompt_ids(str(model), None, 1, engine="llama.cpp", forced=prompt_tokens, n_new=new_tokens,
                          followup=followup)[0]
    with LlamaRunner(str(model), vocab_only=True) as r:
        count = lambda t: len(r.tokenize(t, add_special=True))  # noqa: E731
        text = next((t for t in (forced_texts(None, 1)[0], session_texts(1)[0])
                     if r.tokenize(t, add_special=True) == ids), None)
        if text is None:
            raise MboltError(f"{model}: the mbolt arms' text is neither the built-in nor the session text")
        lo, hi = 1, len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if count(text[:mid]) >= prompt_tokens else (mid + 1, hi)
        return text[:lo]


def run_prompt_round(build: PeerBuild, arm: PromptArm, model: Path, prompt: Path, *, ram: int,
                     threads: int = 2, threshold: float = 0.01) -> dict:
    """One arm-round: a fresh llama-cli process (bench.peers.run_cold), its time to first token."""
    model, prompt = Path(model).resolve(), Path(prompt).resolve()
    argv = cli_argv(build, arm, model, prompt, threads=threads)
    out, row = run_cold(arm.peer, model, argv, ram=ram, mark=PROMPT_MARK, tool="llama-cli", threshold=threshold)
    ttft, n = parse_prompt_eval(out, f"arm {arm.name}")
    return {**row, "n_ubatch": arm.n_ubatch, "prompt_tokens": n, "ttft_s": ttft, "prompt_tokens_per_s": n / ttft}


def run_prompt_peers(build: PeerBuild, arms: list[PromptArm], model: Path, prompt: Path, *, rounds: int, ram: int,
                     threads: int = 2, seed: int = 0, progress=None) -> dict:
    """Every arm once per round in bench.design's balanced orders; per arm the median TTFT over
    its rounds that were cold (a warm arm's rounds all count)."""
    import numpy as np

    from mbolt.bench.design import run_rounds

    rows, orders = run_rounds(arms, rounds, seed, progress=progress, one_round=lambda a: run_prompt_round(
        build, a, model, prompt, ram=0 if a.peer.warm else ram, threads=threads))
    summary = []
    for a in arms:
        xs = [r["ttft_s"] for r in rows if r["arm"] == a.name and not r["rejected"]]
        summary.append({"arm": a.name, "n_ubatch": a.n_ubatch, "flags": a.peer.flags(), "warm": a.peer.warm,
                        "control_of": a.peer.control_of, "ttft_s": float(np.median(xs)) if xs else None,
                        "ttft_s_rounds": xs})
    limited = [s for s in summary if s["ttft_s"] is not None and not s["control_of"] and not s["warm"]]
    best = min(limited, key=lambda s: s["ttft_s"], default=None)
    tokens = sorted({r["prompt_tokens"] for r in rows})
    return {"engine": "ik_llama.cpp", "commit": build.stamp.get("commit"), "threads": threads, "budget_bytes": ram,
            "fed": FED.format(tokens=tokens, batch=2048), "prompt_tokens": tokens,
            "orders": orders, "rounds": rows, "summary": summary,
            "best_arm": best and best["arm"], "best_ttft_s": best and best["ttft_s"], "aa": aa_of(summary, "ttft_s")}


def ttft_beside(mbolt_ttft_s: float | None, llama_warm_ttft_s: float | None, limited: dict, warm: dict) -> dict:
    """What tells kernels from I/O for a prompt: each engine's TTFT warm, mbolt's over the best peer
    arm's under the limit (below 1: mbolt first), and how far each falls from its own warm time."""
    div = lambda a, b: a / b if a and b else None  # noqa: E731
    ik_warm = min((s["ttft_s"] for s in warm["summary"] if s["ttft_s"]), default=None)
    best = limited["best_ttft_s"]
    return {"best_peer_arm": limited["best_arm"], "best_peer_ttft_s": best, "mbolt_ttft_s": mbolt_ttft_s,
            "mbolt_over_best_peer": div(mbolt_ttft_s, best), "ik_warm_ttft_s": ik_warm,
            "llama_cpp_warm_ttft_s": llama_warm_ttft_s,
            "ik_kernels_over_llama_cpp_warm": div(llama_warm_ttft_s, ik_warm),
            "best_peer_over_its_warm": div(best, ik_warm), "mbolt_over_llama_cpp_warm": div(mbolt_ttft_s, llama_warm_ttft_s),
            "note": "the peer arms run after the mbolt arms at the same readahead and budget (not inside their rounds): "
                    "ratios across engines are of medians; ik's prompt is its own tokenization of the same text"}
