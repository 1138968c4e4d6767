"""Recent uses per block key (router.estimates.prefix_uses): counts, the idle window, the bound. What the
router makes of them: tests/test_dispatch_queue_rules.py (a conversation's follow-up waits
longer than a hot prefix)."""
from __future__ import annotations

import pytest

from router.estimates.prefix_uses import PrefixUses


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_counts_requests_through_each_key_and_forgets_an_idle_key():
    clock = Clock()
    uses = PrefixUses(window_s=60.0, clock=clock)
    system = [11, 12, 13]
    uses.record(system + [21, 22])  # conversation A, turn 1
    uses.record(system + [31])  # conversation B
    clock.now += 30
    uses.record(system + [21, 22, 23, 24])  # A, turn 2
    assert [uses.uses(k) for k in system] == [3, 3, 3]  # the shared system prompt is hot
    assert [uses.uses(k) for k in (21, 22, 23, 24, 31)] == [2, 2, 1, 1, 1]
    assert uses.uses(99) == 0
    clock.now += 61  # past the window since every key's last use
    assert uses.uses(11) == 0 and uses.uses(24) == 0
    uses.record([11])  # a use after an idle window starts again from 1
    assert uses.uses(11) == 1


def test_a_key_repeated_in_one_chain_counts_once():
    uses = PrefixUses(clock=Clock())
    uses.record([5, 5, 6])
    assert (uses.uses(5), uses.uses(6)) == (1, 1)


def test_bounded_least_recently_used_keys_go_first():
    clock = Clock()
    uses = PrefixUses(window_s=60.0, max_keys=4, clock=clock)
    uses.record([1, 2, 3])
    clock.now += 1
    uses.record([4, 5])
    assert len(uses) == 4
    assert uses.uses(1) == 0 and [uses.uses(k) for k in (2, 3, 4, 5)] == [1, 1, 1, 1]
    clock.now += 1
    uses.record([2])  # 2 is now the most recent; 3 is the oldest
    uses.record([6])
    assert uses.uses(3) == 0 and [uses.uses(k) for k in (2, 4, 5, 6)] == [2, 1, 1, 1]


def test_expired_keys_are_dropped_on_the_next_record():
    clock = Clock()
    uses = PrefixUses(window_s=10.0, clock=clock)
    uses.record(list(range(100)))
    clock.now += 11
    uses.record([500])
    assert len(uses) == 1


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        PrefixUses(window_s=0)
    with pytest.raises(ValueError):
        PrefixUses(max_keys=0)

