"""The streaming runtime's memory budget: what it must hold, the micro-batch a prompt is evaluated
in, and what is left for the expert cache.

A budget (`--ram`, else the cgroup's limit, else available memory) holds, from load on:
- the dense weights (kept resident: locked, or copied into anonymous memory, runtime.pages);
- llama.cpp's context: the KV cache for `n_ctx` (resident from creation) and the compute buffer
  of an `n_ubatch`-token pass (resident while a prompt runs; the runtime gives its pages back after
  each prompt, so a decode step holds only what its own graph of n_seq rows touches), sized by
  llama.cpp's own memory-fit pass before anything is allocated (runtime.memory);
- this process (interpreter, libraries) and a margin;
- what one layer reads beyond the cache: a decode step's k experts, or a prompt pass's union of
  experts (up to the whole layer), twice that when the next layer is read while this one computes;
- the rest: a per-layer LRU of expert slots.

A prompt of T tokens is ceil(T / n_ubatch) passes over the experts, and each pass reads the experts
the cache does not hold. `plan_budget` takes the largest micro-batch up to the request (default
runtime.memory.default_ubatch) whose compute buffer and pass fit; a budget that cannot hold even one token's
pass (the dense weights, the KV cache and the k experts of one step) is refused before anything is
allocated, naming the largest context that fits.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

from mbolt.core.errors import MboltError
from mbolt.core.moe_map import MoeMap
from mbolt.runtime.memory import ContextMemory, largest_ctx, simulate

LLAMA_EXTRA = 16 << 20  # llama.cpp's own structures, threads and work buffers beyond the process before the load

BUDGET_MARGIN = 32 << 20  # bytes left free (or 5% of the budget): allocator slack, the Python heap's growth
PREFETCH_SHARE = 0.5  # a pass that selects at least this share of a layer's experts reads the next layer ahead


def margin(budget: int) -> int:
    return max(BUDGET_MARGIN, budget // 20)


def expert_bytes_all_layers(mm: MoeMap) -> int:
    """Bytes of one expert in every MoE layer (what one slot of the per-layer cache costs)."""
    return sum(l.expert_bytes for l in mm.moe_layers)


def step_bytes(mm: MoeMap, n_seq: int = 1) -> int:
    """What a decode step's layer needs beyond the cache: the k experts of each of its n_seq
    sequences (at most the whole layer), read before the victims go."""
    return max(l.expert_bytes for l in mm.moe_layers) * min(mm.n_experts, mm.n_used * max(int(n_seq), 1))


def pass_bytes(mm: MoeMap, n_ubatch: int) -> int:
    """What a prompt pass's layer needs beyond the cache: the union of n_ubatch tokens' experts in
    the largest layer (read before its matmuls; the victims go once the layer is done)."""
    return max(l.expert_bytes for l in mm.moe_layers) * min(mm.n_experts, n_ubatch * mm.n_used)


def layer_bytes(mm: MoeMap) -> int:
    """Every expert of the largest MoE layer."""
    return max(l.expert_bytes for l in mm.moe_layers) * mm.n_experts


def slots_for(mm: MoeMap, budget: int, used: int, reserve: int) -> int:
    """Per-layer expert slots that fit in `budget` when `used` bytes are taken already and `reserve`
    is what one layer reads beyond the cache; at least the k experts a token uses."""
    free = budget - used - margin(budget) - reserve
    return int(min(mm.n_experts, max(mm.n_used, free // max(expert_bytes_all_layers(mm), 1))))


@dataclass
class BudgetPlan:
    """How a budget is spent before the model is loaded (bytes)."""

    budget: int
    n_ctx: int
    n_ubatch: int
    prefetch: bool  # a prompt pass reads the next layer while this one computes
    dense_bytes: int
    process_bytes: int
    memory: ContextMemory
    prefill_reserve: int  # one layer's pass (two with prefetch)
    step_reserve: int  # one layer of a decode step of n_seq sequences
    n_seq: int = 1
    decode_compute_bytes: int = 0  # the compute buffer a decode step's graph (n_seq rows) touches

    @property
    def fixed(self) -> int:
        return self.dense_bytes + self.process_bytes + self.memory.total + margin(self.budget)

    def decode_slots_lost(self, mm: MoeMap) -> int:
        """The decode cache slots per layer a decode step's part of the compute buffer takes."""
        return self.decode_compute_bytes // max(expert_bytes_all_layers(mm), 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = asdict(self.memory)
        return d


def ubatch_candidates(limit: int) -> list[int]:
    """limit, then the powers of two below it, down to 1."""
    out = [int(limit)]
    p = 1 << (int(limit).bit_length() - 1)
    if p == limit:
        p //= 2
    while p >= 1:
        out.append(p)
        p //= 2
    return out


def decode_compute(path: str, n_ctx: int, rows: int, mem: ContextMemory, flash_attn: bool, f32_kv: bool,
                   n_seq: int) -> int:
    """The part of the compute buffer a decode step of `rows` rows touches once the runtime gave the
    buffer back after a prompt: llama.cpp's size for that graph twice, plus 64 KiB (its allocator
    leaves holes between nodes and pages are touched whole: measured 2.2x on the tests' model and
    2.1x on q72), never more than the buffer."""
    one = simulate(path, n_ctx, rows, flash_attn=flash_attn, f32_kv=f32_kv, n_seq=n_seq).compute_bytes
    return min(2 * one + (64 << 10), mem.compute_bytes)


def process_bytes_now() -> int:
    """The budget's input for this process: its own memory before the load (runtime.arm.own_bytes)
    and what llama.cpp will add beyond the weights, the KV cache and the compute buffer."""
    from mbolt.runtime.arm import own_bytes

    return own_bytes() + LLAMA_EXTRA


def plan_budget(path: str, mm: MoeMap, budget: int, *, n_ctx: int, n_ubatch: int, dense_bytes: int,
                process_bytes: int | None = None, flash_attn: bool = True, f32_kv: bool = False,
                n_seq: int = 1) -> BudgetPlan:
    """The largest micro-batch up to `n_ubatch` that the budget holds with a k-slot cache: with the
    next layer read ahead when two layers' passes fit, else one. `n_seq` sequences of `n_ctx`
    tokens (a server's slots: their KV caches, and a decode step that reads up to n_seq x k experts
    of a layer). Refuses (one line, the largest context that would fit) when not even a one-token
    pass fits. `process_bytes`: this process's memory beyond those (default: process_bytes_now)."""
    process_bytes = process_bytes_now() if process_bytes is None else process_bytes
    k_slots = mm.n_used * expert_bytes_all_layers(mm)
    base = dense_bytes + process_bytes + margin(budget) + k_slots

    step = step_bytes(mm, n_seq)
    for ub in ubatch_candidates(min(n_ubatch, n_ctx)):
        mem = simulate(path, n_ctx, ub, flash_attn=flash_attn, f32_kv=f32_kv, n_seq=n_seq)
        one = max(pass_bytes(mm, ub), step)
        for prefetch, reserve in ((True, one + layer_bytes(mm)), (False, one)):
            if prefetch and one < PREFETCH_SHARE * layer_bytes(mm):
                continue  # passes this small select too little of a layer to read the next one whole
            if base + mem.total + reserve <= budget:
                return BudgetPlan(budget, mem.n_ctx, ub, prefetch, dense_bytes, process_bytes, mem, reserve, step, n_seq,
                                  decode_compute(path, n_ctx, min(ub, max(n_seq, 1)), mem, flash_attn, f32_kv, n_seq))

    def fits(n: int) -> bool:
        m = simulate(path, n, 1, flash_attn=flash_attn, f32_kv=f32_kv, n_seq=n_seq)
        return base + m.total + step <= budget

    best = largest_ctx(fits, n_ctx)
    mem = simulate(path, n_ctx, 1, flash_attn=flash_attn, f32_kv=f32_kv, n_seq=n_seq)
    mib = 2**20
    slots = f"{n_seq} slots of a {n_ctx}-token context" if n_seq > 1 else f"a {mem.n_ctx}-token context"
    parts = (f"the dense weights ({dense_bytes / mib:.0f} MiB, kept resident), the KV cache of {slots} "
             f"({mem.kv_bytes / mib:.0f} MiB), llama.cpp's buffers ({(mem.compute_bytes + mem.output_bytes) / mib:.0f} "
             f"MiB), a cache of the {mm.n_used} experts of one step and their reads ({(k_slots + step_bytes(mm)) / mib:.0f} "
             f"MiB), this process ({process_bytes / mib:.0f} MiB) and a margin ({margin(budget) / mib:.0f} MiB)")
    need = base + mem.total + step
    hint = (f"the largest context that fits is {best} tokens (-c {best}), or give a larger --ram" if best
            else "no context fits: give a larger --ram")
    raise MboltError(f"{mm.paths[0]}: a budget of {budget / mib:.0f} MiB cannot hold {parts}: {need / mib:.0f} MiB; {hint}")


def expected_decode_slots(plan: BudgetPlan, mm: MoeMap) -> int:
    """The decode cache's slots per layer a plan leaves once loaded: the budget less the dense
    weights, this process, the KV cache, the output buffer, a decode step's part of the compute
    buffer (given back after a prompt) and one step's reads. An estimate before the load (q864 at
    40%: 35, 33, 29 for 1, 2, 4 sequences where the loaded runtime had 34, 32, 29)."""
    used = (plan.dense_bytes + plan.process_bytes + plan.memory.kv_bytes + plan.memory.output_bytes
            + plan.decode_compute_bytes)
    return slots_for(mm, plan.budget, used, plan.step_reserve)


class Budget:
    """The one object that plans and enforces a run's memory budget (bytes `limit`).

    plan    before the model is loaded: the micro-batch, read-ahead or not, refused in one line when
            nothing fits (`plan_budget`);
    fit     after the load, the dense weights held: the expert slots per layer of a prompt pass and
            of a decode step, from what is used (inside the group that enforces the limit, its
            charge; elsewhere the dense weights and this process's own memory); a budget that holds
            every expert caches them all, in prompts too;
    keep    before a decode step, now and then: inside that group, when its charge has crept within
            half the margin of the limit (memory the plan does not see: the interpreter's heap,
            page cache of other files), the cache gives up as many slots as it took, for good,
            before the kernel starts reclaiming cached experts (which then come back through 4 KiB
            faults: about 1,600 in one run of q72 at 40%).
    A batched decode step of n sequences reads up to n x k experts of a layer: `decode_slots(n)`.
    """

    KEEP_EVERY = 16  # decode steps between two reads of the group's charge (a file read: ~15 us)

    def __init__(self, limit: int, mm: MoeMap, plan: BudgetPlan):
        self.limit, self.mm, self.plan = int(limit), mm, plan
        self.prefill_slots = self.decode_slots = 0
        self.own_group = False
        self.given_back = 0
        self._steps = 0

    @classmethod
    def planned(cls, limit: int, mm: MoeMap, model_path: str, **kw) -> "Budget":
        return cls(limit, mm, plan_budget(model_path, mm, limit, **kw))

    def fit(self, used_outside: int, compute_pending: int, decode_pending: int | None = None) -> None:
        """Size the cache. `used_outside`: the dense weights held and this process's memory
        (taken when this process is not alone in the group that enforces the limit);
        `compute_pending`: the compute buffer's bytes not resident now that a prompt pass will
        touch; `decode_pending`: those a decode step will (default: the same)."""
        from mbolt.core.memlimit import group_usage, own_limit

        lim = own_limit()
        used = None
        if lim is not None and lim <= self.limit:  # v1 rounds a limit down to whole pages
            self.limit = lim
            used = group_usage()
            self.own_group = used is not None
        if used is None:
            used = used_outside
        decode_used = used + (compute_pending if decode_pending is None else decode_pending)
        used += compute_pending
        if slots_for(self.mm, self.limit, used, 0) >= self.mm.n_experts:
            # every expert fits: what a pass or a step reads is cached for good, so no reserve for
            # reads beyond the cache and no prompt shrinks it (a shrink dropped experts that the
            # next decode steps read back from the drive: 40 MB a token at 48 layers)
            self.prefill_slots = self.decode_slots = self.mm.n_experts
            return
        self.prefill_slots = slots_for(self.mm, self.limit, used, self.plan.prefill_reserve)
        self.decode_slots = max(self.prefill_slots, slots_for(self.mm, self.limit, decode_used, self.plan.step_reserve))

    def compute_kept(self) -> None:
        """The compute buffer stayed resident after a prompt (its pages could not be given back):
        decode gives up the slots `fit` counted on, for good."""
        extra = self.plan.memory.compute_bytes - self.plan.decode_compute_bytes
        n = -(-max(extra, 0) // max(expert_bytes_all_layers(self.mm), 1))
        if n and self.decode_slots < self.mm.n_experts:
            self.decode_slots = max(self.prefill_slots, self.mm.n_used, self.decode_slots - n)

    def keep(self) -> bool:
        """Before a decode step: True when the cache gave up slots (`decode_slots` is smaller)."""
        self._steps += 1
        if not self.own_group or self._steps % self.KEEP_EVERY:
            return False
        from mbolt.core.memlimit import group_usage

        used = group_usage()
        if used is None:
            return False
        over = used - (self.limit - margin(self.limit) // 2)
        if over <= 0:
            return False
        n = -(-over // max(expert_bytes_all_layers(self.mm), 1))
        self.decode_slots = max(self.mm.n_used, self.decode_slots - n)
        self.prefill_slots = min(self.prefill_slots, self.decode_slots)
        self.given_back += n
        return True

    def describe(self, memory, locked_bytes: int, copied_bytes: int, pinned: int, laid_over: bool = False) -> str:
        """One line: where the budget goes (`memory`: what llama.cpp logged, else the plan's;
        `laid_over`: prompt passes are laid over with huge pages, runtime.prefill.PassOverlay)."""
        p, mib = self.plan, 2**20
        mem = memory or p.memory
        held = f"{locked_bytes / 1e6:.0f} MB of dense weights locked"
        if copied_bytes:
            held += f", {copied_bytes / 1e6:.0f} MB held as anonymous copies (RLIMIT_MEMLOCK)"
        lost = p.decode_slots_lost(self.mm)
        return (f"{held}; context {mem.n_ctx} tokens (KV cache {mem.kv_bytes / mib:.0f} MiB); prompt passes of "
                f"{p.n_ubatch} tokens (compute buffer {mem.compute_bytes / mib:.0f} MiB, given back after a prompt; "
                f"a decode step's {p.decode_compute_bytes / mib:.1f} MiB: {lost} decode slot{'s' if lost != 1 else ''}"
                f"{', next layer read ahead' if p.prefetch else ''}"
                f"{' (layers laid over: huge pages filled by O_DIRECT)' if laid_over else ''}); "
                f"{self.decode_slots} expert slots per layer ({self.prefill_slots} during a prompt, {pinned} pinned)")


@contextmanager
def budget_inputs(path, mm: MoeMap, kernel=None, pages=None):
    """What a budget is planned from before a load (runtime.budget.plan_budget): a path llama.cpp's
    memory-fit pass reads for `path` (a kernel-layout file's stand-in: stock llama.cpp refuses the
    file itself) and the dense weights' bytes the arm will hold (the mapped runtime: their pages;
    the kernel layout: their copies). What the caller opened already is used, not opened again:
    `kernel`, the kernel-layout file's header; `pages`, the mapped file's runtime.pages.ExpertPages."""
    if kernel is None:
        from mbolt.core.gguf_set import open_model_header
        from mbolt.core.kernel_file import is_kernel_file, read_kernel

        kernel = read_kernel(path) if is_kernel_file(open_model_header(path)) else None
    if kernel is not None:
        from mbolt.runtime.kernel_load import stand_in

        dense = sum(t.nbytes for t in mm.header.tensors) - sum(
            w.nbytes for layer in mm.moe_layers for w in layer.weights)
        with stand_in(kernel) as shadow:
            yield shadow, dense
        return
    if pages is not None:
        yield str(path), pages.dense_bytes()
        return
    from mbolt.runtime.pages import ExpertPages

    pages = ExpertPages(path, mm)
    try:
        dense = pages.dense_bytes()
    finally:
        pages.close()
    yield str(path), dense
