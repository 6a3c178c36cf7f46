"""The peer's time to first token beside the runtime's (issue 35): ik_llama.cpp (bench.peers: the
registry's package in its own environment) evaluates the prompt the mbolt arms are given (their
own token ids) and its logits are read, cold under the same memory cgroup (bench.peers.run_round:
the file dropped, the experts' pages dropped again after its load), or warm (the file in memory,
no limit), at a given prompt pass size (n_ubatch).

Its time to first token is the prompt's llama_decode and the reading of its last logits (load
excluded), as the mbolt arms' TTFT is the prompt's llama_decode calls and their reads.
"""

from __future__ import annotations

from mbolt.bench.peers import IkPeer, PeerArm, aa_of, run_round

PROMPT_CTX = 4096  # room for a 2,000-token prompt

FED = ("ik-llama-cpp-python's bindings (bench/ik_worker.py): the mbolt arms' prompt, its {tokens} token ids, in one "
       "llama_decode (passes of n_ubatch tokens inside), the last token's logits read; timed: that call and the "
       "reading (load excluded); n_ctx {n_ctx}, flash attention on. Cold arms: once loaded, the expert tensors' "
       "pages unmapped from the process and dropped from the page cache (mincore checked) before the prompt: the "
       "mbolt arms' cold start.")


def prompt_arms(n_ubatches=(512, 2048), aa: bool = True) -> list[PeerArm]:
    """Under the limit: ik mapped at each pass size (512 is ik's default; A/A of the first)."""
    arms = [PeerArm(f"ik-{n}", n_ubatch=n) for n in n_ubatches]
    if aa:
        arms.insert(1, PeerArm(f"ik-{n_ubatches[0]} (A/A)", control_of=f"ik-{n_ubatches[0]}", n_ubatch=n_ubatches[0]))
    return arms


def warm_prompt_arms(n_ubatches=(512, 2048)) -> list[PeerArm]:
    return [PeerArm(f"ik-warm-{n}", warm=True, n_ubatch=n) for n in n_ubatches]


def run_prompt_round(peer: IkPeer, arm: PeerArm, model, prompt: list[int], *, ram: int, n_ctx: int = PROMPT_CTX,
                     threads: int = 2, threshold: float = 0.01) -> dict:
    """One arm-round: a fresh worker (bench.peers.run_round) given the prompt and nothing to feed."""
    row = run_round(peer, arm, model, prompt, [], ram=ram, n_ctx=n_ctx, threads=threads, threshold=threshold)
    return {**row, "prompt_tokens_per_s": row["prompt_tokens"] / row["ttft_s"]}


def run_prompt_peers(peer: IkPeer, arms: list[PeerArm], model, prompt: list[int], *, rounds: int, ram: int,
                     n_ctx: int = PROMPT_CTX, threads: int = 2, seed: int = 0, progress=None) -> dict:
    """Every arm once per round in bench.design's balanced orders; per arm the median TTFT over
    its rounds that were cold (a warm arm's rounds all count)."""
    import numpy as np

    from mbolt.bench.design import run_rounds

    rows, orders = run_rounds(arms, rounds, seed, progress=progress, one_round=lambda a: run_prompt_round(
        peer, a, model, prompt, ram=0 if a.warm else ram, n_ctx=n_ctx, threads=threads))
    summary = []
    for a in arms:
        xs = [r["ttft_s"] for r in rows if r["arm"] == a.name and not r["rejected"]]
        summary.append({"arm": a.name, "n_ubatch": a.n_ubatch, "warm": a.warm, "control_of": a.control_of,
                        "ttft_s": float(np.median(xs)) if xs else None, "ttft_s_rounds": xs})
    limited = [s for s in summary if s["ttft_s"] is not None and not s["control_of"] and not s["warm"]]
    best = min(limited, key=lambda s: s["ttft_s"], default=None)
    return {**peer.record(), "threads": threads, "budget_bytes": ram,
            "fed": FED.format(tokens=len(prompt), n_ctx=n_ctx), "prompt_tokens": len(prompt),
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
                    "ratios across engines are of medians; the peer is given the same prompt ids"}
