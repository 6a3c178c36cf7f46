"""The expert store serves exactly the file's bytes under every reader option."""

import itertools
import os

import gguf
import numpy as np
import pytest

from mbolt.core.pagecache import evict, resident_pages, resident_share
from mbolt.runtime.store import ExpertStore
from mbolt.core.errors import MboltError


def write_tiny(path, n_layers=2, n_experts=8, hidden=64, ff=24, k=2, seed=0):
    """A small qwen3moe-named GGUF with F32 experts (6 KiB slices: not page aligned)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(n_layers)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(k)
    for l in range(n_layers):
        w.add_tensor(f"blk.{l}.ffn_gate_inp.weight", rng.standard_normal((n_experts, hidden)).astype(np.float32))
        for n in ("gate", "up"):
            w.add_tensor(f"blk.{l}.ffn_{n}_exps.weight", rng.standard_normal((n_experts, ff, hidden)).astype(np.float32))
        w.add_tensor(f"blk.{l}.ffn_down_exps.weight", rng.standard_normal((n_experts, hidden, ff)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_slices(path):
    """Independently of the store: gguf-py's reader, expert e = row e of the 3-D tensor."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        if "_exps." in t.name:
            l = int(t.name.split(".")[1])
            role = t.name.split(".")[2][4:-5]  # ffn_gate_exps -> gate
            data = np.asarray(t.data)
            out[(l, role)] = [data[e].tobytes() for e in range(data.shape[0])]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = write_tiny(tmp_path_factory.mktemp("store") / "tiny.gguf")
    return p, expected_slices(p)


REQUESTS = [[5, 1, 7], [1, 2], [5, 1, 7], [0, 1, 2, 3, 4, 5, 6, 7], [3], [7, 6]]

OPTIONS = [
    dict(),
    dict(gap=4096),
    dict(gap=1 << 20),
    dict(io_threads=4),
    dict(direct=True),
    dict(direct=True, io_threads=3, gap=7000),
    dict(cache_slots=3),
    dict(resident_frac=0.5, io_threads=2),
    dict(mode="os"),
    dict(mode="os", cache_slots=2),
    dict(drop_pages=False),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_every_served_expert_equals_file_bytes(tiny, opts):
    path, want = tiny
    with ExpertStore(path, **opts) as s:
        for ids, l in itertools.product(REQUESTS, (0, 1)):
            got = s.fetch(l, ids)
            assert sorted(got) == sorted(set(ids))
            for e in ids:
                assert list(got[e]) == ["gate", "up", "down"]
                for role, arr in got[e].items():
                    assert arr.dtype == np.uint8 and arr.tobytes() == want[(l, role)][e]
        c = s.snapshot()
        assert c.hits + c.misses == c.experts == 2 * sum(len(r) for r in REQUESTS)


def test_counters_by_hand(tiny):
    path, _ = tiny
    # stock file: gate, up, down are three tensors; experts 1 and 2 are adjacent in each
    with ExpertStore(path) as s:
        s.read(0, [1, 2])
        assert (s.counters.reads, s.counters.bytes) == (3, 6 * 6144)
        s.read(0, [1, 5])
        assert s.counters.reads == 3 + 6
    with ExpertStore(path, gap=2 * 6144) as s:
        # the 2 slices between experts 1 and 4 fit in the gap; the 4 between a tensor's expert 4
        # and the next tensor's expert 1 do not: one read of 4 slices per tensor
        s.read(0, [1, 4])
        assert (s.counters.reads, s.counters.bytes) == (3, 3 * 4 * 6144)
    with ExpertStore(path, cache_slots=2) as s:
        for ids in ([1, 2], [2, 3], [1, 3]):
            s.read(0, ids)
        # [1,2]: 2 misses; [2,3]: 2 hit, 3 miss -> cache {2,3}; [1,3]: 1 miss, 3 hit
        assert (s.counters.hits, s.counters.misses) == (2, 4)


def test_direct_reads_are_aligned(tiny):
    path, _ = tiny
    with ExpertStore(path, direct=True) as s:
        s.read(1, [3])
        assert s.counters.bytes % 4096 == 0 and s.counters.bytes >= 3 * 6144


def test_buffered_reads_leave_no_pages(tiny):
    path, _ = tiny
    evict(path)
    with ExpertStore(path) as s:
        s.read(0, [0, 1, 2, 3])
    assert resident_pages(path).sum() == 0
    with ExpertStore(path, mode="os") as s:
        s.read(1, [4, 5])
    assert resident_pages(path).sum() == 0
    with ExpertStore(path, drop_pages=False) as s:
        s.read(0, [0])
    assert resident_pages(path).sum() > 0


def test_evict_is_proven_by_mincore(tmp_path):
    p = tmp_path / "blob"
    p.write_bytes(os.urandom(1 << 20))
    with open(p, "rb") as f:
        f.read()
    assert resident_share(p) > 0.5
    ev = evict(p)
    assert ev.proven and ev.resident_after <= 0.01


def test_bad_options(tiny):
    import hashlib

    path, _ = tiny
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(MboltError):
        ExpertStore(path, mode="os", direct=True)
    with pytest.raises(MboltError):
        ExpertStore(path, io_threads=0)
    with ExpertStore(path) as s, pytest.raises(MboltError, match="expert 8 out of range"):
        s.fetch(0, [8])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before  # refused before touching anything


@pytest.fixture(scope="module")
def rewritten(tiny, tmp_path_factory):
    from mbolt.rewrite.reorder import reorder

    path, _ = tiny
    d = tmp_path_factory.mktemp("rewritten")
    perm = np.stack([np.random.default_rng(l).permutation(8) for l in range(2)]).astype(np.int32)
    out = {}
    for layout in ("reorder", "packed"):
        out[layout] = d / f"{layout}.gguf"
        reorder(path, out[layout], perm, layout=layout, method="test", sidecar=False)
    return out


@pytest.mark.parametrize("layout", ["reorder", "packed"])
@pytest.mark.parametrize("opts", [dict(), dict(gap=8192, io_threads=2), dict(direct=True), dict(mode="os"),
                                  dict(cache_slots=2, direct=True)], ids=str)
def test_rewritten_files_serve_original_experts(tiny, rewritten, layout, opts):
    """Experts asked for by ORIGINAL id from a permuted file equal the stock file's bytes."""
    _, want = tiny
    with ExpertStore(rewritten[layout], **opts) as s:
        for ids, l in itertools.product(REQUESTS, (0, 1)):
            got = s.fetch(l, ids)
            for e in ids:
                for role, arr in got[e].items():
                    assert arr.tobytes() == want[(l, role)][e]


def test_packed_reads_one_range_per_run(rewritten):
    from mbolt.core.routemap import read_route_map

    rm = read_route_map(rewritten["packed"])
    p0 = rm.perm[0]
    with ExpertStore(rewritten["packed"]) as s:
        s.read(0, [p0[2], p0[3]])  # adjacent positions: gate|up|down of both in one read
        assert s.counters.reads == 1
        s.read(0, [p0[0], p0[5]])
        assert s.counters.reads == 3


def test_split_reads_stay_byte_exact(tiny, monkeypatch):
    """With QD > 1 long merged reads are split into pieces (here forced small): same bytes."""
    import mbolt.core.ranges as ranges_mod

    monkeypatch.setattr(ranges_mod, "SPLIT_MIN", 4096)
    path, want = tiny
    for direct in (False, True):
        with ExpertStore(path, io_threads=6, gap=1 << 20, direct=direct) as s:
            got = s.fetch(1, list(range(8)))
            # one read per tensor (never across tensors, as the evaluator scores), each cut in pieces
            assert s.counters.reads == 3 and s.counters.ops >= 6
            for e in range(8):
                for role, arr in got[e].items():
                    assert arr.tobytes() == want[(1, role)][e]


def test_split_jobs_by_hand():
    from mbolt.core.ranges import split_jobs

    # one 1 MiB read, QD 4: pieces of max(256 KiB, 1 MiB / 4) = 256 KiB
    jobs = split_jobs([(4096, 1 << 20, 0)], 4)
    assert jobs == [(4096 + i * (256 << 10), 256 << 10, i * (256 << 10)) for i in range(4)]
    # small reads are never split
    assert split_jobs([(0, 1000, 0), (5000, 2000, 4096)], 4) == [(0, 1000, 0), (5000, 2000, 4096)]


def test_pinned_experts_stay_and_the_rest_is_lru(tiny):
    """Pins (the learned-pin policy): a pinned expert, once read, is never evicted; the other
    slots are an LRU. Checked by which calls read (misses) and which do not."""
    evicted = []
    path = tiny[0]
    with ExpertStore(path, cache_slots=3, on_evict=lambda layer, e: evicted.append(e)) as s:
        s.pin(0, [5])
        s.read(0, [5])  # a pinned expert is read on first use
        for e in (1, 2, 3, 4):  # four more through two LRU slots
            s.read(0, [e])
        assert s.counters.misses == 5 and evicted == [1, 2]
        s.read(0, [5])
        assert s.counters.hits == 1  # still there after 4 others
        s.read(0, [1])  # 1 left long ago: a miss that evicts 3 (the LRU), never 5
        assert s.counters.misses == 6 and evicted == [1, 2, 3]
        with pytest.raises(MboltError, match="3 pins leave no LRU slot of 3"):
            s.pin(0, [1, 2, 3])
