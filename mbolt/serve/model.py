"""The model a server (or the terminal chat) runs: the runtime's one driver (runtime.driver),
the same path `generate` and the benchmarks run, with `parallel` sequences (slots).

`open_model` plans the budget before anything is loaded (a budget that cannot hold the model's
dense weights, the KV cache of every slot's context and one step's experts is one error line),
loads, then holds the dense weights and sizes the expert cache. `plain=True` is the same server
over plain llama.cpp (mapped, no repacking, no callback): what the runtime is measured against.
A kernel-layout file (`mbolt repack`) is served by the runtime over it (runtime.kernel_stream),
planned over its stand-in; `plain=True` refuses it (runtime.kernel_stream.kernel_arm, the one refusal).
Without `parallel`, the budget chooses: the most slots up to 4 whose KV caches take at most an
eighth of it and whose working sets the expert cache holds (WORKING_SETS x n x k slots per layer,
as the plan expects them once loaded), 1 when only one fits. The second rule is from
results/batch_*.json: on q864 at 40% (29-34 slots of 128, k=8) four interleaved conversations cut
the hit rate from 0.83 to 0.60 and decoded 0.95x one conversation's total rate, where two gained
1.11x; on q72 (126-134 slots of 512, k=10) four gained 1.44x. The rule picks 2 and 4 there.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import Keys

from mbolt.core.errors import MboltError
from mbolt.runtime.memory import DEFAULT_UBATCH

MAX_AUTO_PARALLEL = 4
KV_SHARE = 8  # automatic slots: their KV caches take at most 1/KV_SHARE of the budget
WORKING_SETS = 2  # automatic slots: the decode cache holds this many steps' experts of every slot


@dataclass
class Loaded:
    """A model ready to serve: the driver, what the budget line says, llama.cpp's abort flag."""

    driver: object
    abort: object
    n_ctx: int
    n_ubatch: int
    budget: int | None
    budget_from: str
    metadata: dict

    @property
    def streaming(self) -> bool:
        """The runtime streams the experts (else plain llama.cpp)."""
        return self.driver.streaming

    def close(self) -> None:
        self.driver.close()


def auto_parallel(model_path: str, n_ctx: int, n_ubatch: int, budget: int | None, mm=None) -> int:
    """The slots a budget affords by default (see the module docstring)."""
    if not budget:
        return 1
    from mbolt.core.moe_map import moe_map
    from mbolt.runtime.budget import budget_inputs, expected_decode_slots, plan_budget

    mm = mm or moe_map(model_path, kernel_ok=True)
    with budget_inputs(model_path, mm) as (llama_path, dense):
        for n in range(MAX_AUTO_PARALLEL, 1, -1):
            try:
                plan = plan_budget(llama_path, mm, budget, n_ctx=n_ctx, n_ubatch=n_ubatch, dense_bytes=dense,
                                   n_seq=n)
            except MboltError:
                continue
            if (plan.memory.kv_bytes * KV_SHARE <= budget
                    and expected_decode_slots(plan, mm) >= WORKING_SETS * n * mm.n_used):
                return n
    return 1


def open_model(path, *, ram: str | int | None = None, n_ctx: int | None = None, n_ubatch: int | None = None,
               n_threads: int | None = None, plain: bool = False, parallel: int | None = None,
               watchers=()) -> Loaded:
    """Load `path` for serving: mbolt's runtime with the budget (`ram`, else the cgroups' limit,
    else available memory), or plain llama.cpp; `parallel` slots (None: from the budget);
    `watchers` see every step (a routing recorder)."""
    from mbolt.core.gguf_set import open_model_header
    from mbolt.core.memlimit import budget as find_budget
    from mbolt.core.moe_map import moe_map
    from mbolt.runtime.driver import open_driver
    from mbolt.runtime.memory import resolve_ctx

    mm = moe_map(path, kernel_ok=True)  # a kernel-layout file: the map of the model it holds
    limit, where = (None, "") if plain else find_budget(ram)
    ctx, _ = resolve_ctx(n_ctx, mm)
    n_seq = int(parallel) if parallel else auto_parallel(mm.paths[0], ctx, n_ubatch or DEFAULT_UBATCH, limit, mm)
    if n_seq < 1:
        raise MboltError(f"--parallel must be at least 1, got {n_seq}")
    if plain:
        d = open_driver(path, reads=False, evict=False, mm=mm, n_ctx=n_ctx, n_ubatch=n_ubatch, n_threads=n_threads,
                        n_seq=n_seq, watchers=watchers, plain_flag="--plain")
    else:
        d = open_driver(path, reads=True, mm=mm, budget=limit, qd=4, asynchronous=True, n_ctx=n_ctx,
                        n_ubatch=n_ubatch, n_threads=n_threads, n_seq=n_seq, watchers=watchers)
    try:
        abort = d.abort_flag()
        d.make_cold()
        header = open_model_header(path)
        template = header.get(Keys.Tokenizer.CHAT_TEMPLATE)
        meta = {Keys.Tokenizer.CHAT_TEMPLATE: template} if template else {}
    except BaseException:
        d.close()
        raise
    return Loaded(d, abort, d.n_ctx_seq, d.n_ubatch, limit, where, meta)
