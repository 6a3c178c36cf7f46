"""greedy_decode, the reference engine's decode loop: what it feeds, how many forwards, where it stops."""

import numpy as np

from mbolt.reference.generate import greedy_decode


class Counter:
    """A fake model over 10 tokens whose greedy next token is (last fed + 1) mod 10."""

    def __init__(self):
        self.fed = []

    def forward(self, ids):
        self.fed.append(list(ids))
        logits = np.zeros(10)
        logits[(ids[-1] + 1) % 10] = 1.0
        return logits


def test_prefill_then_argmax_fed_back():
    m = Counter()
    steps = list(greedy_decode(m.forward, [3, 4], 3))
    assert m.fed == [[3, 4], [5], [6], [7]]  # 1 prefill + 3 decode forwards
    assert [s.index for s in steps] == [0, 1, 2, 3]
    assert [s.next_token for s in steps] == [5, 6, 7, 8]  # the last choice is not fed


def test_eos_is_chosen_but_not_fed():
    m = Counter()
    steps = list(greedy_decode(m.forward, [7], 10, eos=9))
    assert m.fed == [[7], [8]]
    assert steps[-1].next_token == 9


def test_tuple_results_ride_along_and_2d_logits_use_the_last_row():
    def fwd(ids):
        rows = np.zeros((len(ids), 4))
        rows[-1, 2] = 1.0
        rows[0, 1] = 5.0 if len(ids) > 1 else 0.0  # an earlier row must not decide
        return rows, "extra"

    steps = list(greedy_decode(fwd, [0, 1, 2], 1))
    assert [s.next_token for s in steps] == [2, 2]
    assert steps[0].out[1] == "extra" and steps[1].fed == [2]
