"""The shared read-merging function against a naive byte-by-byte reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mbolt.core.ranges import merge_ranges, merge_ranges_batched


def naive_reads(ranges, gap):
    """Walk the wanted bytes left to right; a hole longer than `gap` starts a new read."""
    ranges = sorted(ranges)
    reads = []
    for s, e in ranges:
        if reads and s <= reads[-1][1] + gap:
            reads[-1][1] = max(reads[-1][1], e)
        else:
            reads.append([s, e])
    return reads


ranges_st = st.lists(
    st.tuples(st.integers(0, 200), st.integers(1, 40)).map(lambda t: (t[0], t[0] + t[1])),
    min_size=1, max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(ranges_st, st.integers(0, 30))
def test_merge_matches_naive(ranges, gap):
    s, e = np.array(ranges).T
    got_s, got_e = merge_ranges(s, e, gap)
    want = naive_reads(ranges, gap)
    assert [[int(a), int(b)] for a, b in zip(got_s, got_e)] == want


@settings(max_examples=100, deadline=None)
@given(st.lists(ranges_st, min_size=1, max_size=6), st.integers(0, 30))
def test_batched_counts_and_bytes(rows, gap):
    m = max(len(r) for r in rows)
    starts = np.zeros((len(rows), m), np.int64)
    ends = np.zeros((len(rows), m), np.int64)
    valid = np.zeros((len(rows), m), bool)
    for i, r in enumerate(rows):
        for j, (s, e) in enumerate(r):
            starts[i, j], ends[i, j], valid[i, j] = s, e, True
    _, _, reads, nbytes = merge_ranges_batched(starts, ends, gap, valid)
    for i, r in enumerate(rows):
        want = naive_reads(r, gap)
        assert reads[i] == len(want)
        assert nbytes[i] == sum(b - a for a, b in want)


def test_touching_ranges_are_one_read_and_far_ones_are_not():
    s, e = merge_ranges([0, 100, 300], [100, 200, 400], gap=0)
    assert s.tolist() == [0, 300] and e.tolist() == [200, 400]
    s, e = merge_ranges([0, 100, 300], [100, 200, 400], gap=100)
    assert s.tolist() == [0] and e.tolist() == [400]
