"""The fluid network against hand-computed max-min fair shares."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.simulator import FluidNetwork


def finishes(changed):
    return {f: t for f, t, _ in changed}


def test_a_lone_flow_runs_at_link_speed():
    net = FluidNetwork([10.0, 4.0])
    assert finishes(net.add(0, (0,), 20.0, now=1.0)) == {0: 3.0}
    net.remove(0, now=3.0)
    assert finishes(net.add(1, (0, 1), 8.0, now=10.0)) == {1: 12.0}  # the slower link of two


def test_two_flows_on_one_link_share_it_and_speed_up_when_one_ends():
    net = FluidNetwork([10.0])
    net.add(0, (0,), 10.0, now=0.0)           # alone: would end at 1.0
    changed = finishes(net.add(1, (0,), 30.0, now=0.5))
    # At 0.5 flow 0 has 5 bytes left, each flow now gets 5 B/s.
    assert changed == {0: pytest.approx(1.5), 1: pytest.approx(6.5)}
    changed = finishes(net.remove(0, now=1.5))
    # Flow 1 moved 5 bytes, has 25 left, now at the full 10 B/s.
    assert changed == {1: pytest.approx(4.0)}


def test_max_min_fairness_gives_the_spare_capacity_to_the_unconstrained_flow():
    # Link 0 (10 B/s) carries flows a and b; link 1 (4 B/s) carries b and c.
    # Max-min: link 1 is the bottleneck (2 each for b and c), a takes the 8 left on link 0.
    net = FluidNetwork([10.0, 4.0])
    net.add(0, (0,), 80.0, now=0.0)
    net.add(1, (0, 1), 20.0, now=0.0)
    changed = finishes(net.add(2, (1,), 20.0, now=0.0))
    assert changed == {0: pytest.approx(10.0), 1: pytest.approx(10.0), 2: pytest.approx(10.0)}


def test_disjoint_flows_do_not_touch_each_other():
    net = FluidNetwork([1.0, 1.0])
    net.add(0, (0,), 5.0, now=0.0)
    assert finishes(net.add(1, (1,), 2.0, now=1.0)) == {1: 3.0}  # flow 0 not rescheduled


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="capacities"):
        FluidNetwork([1.0, 0.0])
    net = FluidNetwork([1.0])
    with pytest.raises(ValueError, match="bytes > 0"):
        net.add(0, (0,), 0.0, now=0.0)


def _scan_fill(capacity: list[float], flows: dict[int, tuple[int, ...]]) -> dict[int, float]:
    """Progressive filling as the textbook states it (Bertsekas and Gallager 6.5.2): each
    round scans every link for the smallest even share of its spare capacity among its
    unfixed flows (ties to the lowest link), and fixes those flows at it."""
    spare = list(capacity)
    unfixed = {f: set(links) for f, links in flows.items()}
    rates = {}
    while unfixed:
        shares = {}
        for link in range(len(capacity)):
            users = [f for f, links in unfixed.items() if link in links]
            if users:
                shares[link] = spare[link] / len(users)
        link = min(shares, key=lambda lk: (shares[lk], lk))
        for f in sorted(f for f, links in unfixed.items() if link in links):
            rates[f] = shares[link]
            for other in flows[f]:
                spare[other] -= shares[link]
            del unfixed[f]
    return rates


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0]), min_size=1, max_size=12),
       st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True), min_size=1, max_size=25))
def test_the_heap_filling_gives_the_textbook_rates_to_the_bit(capacity, link_lists):
    """The network's progressive filling (a heap of shares) gives every flow exactly the
    rate the textbook scan gives, on random flows over shared links, ties included."""
    net = FluidNetwork(capacity)
    flows = {}
    for f, links in enumerate(link_lists):
        links = tuple(sorted({lk % len(capacity) for lk in links}))
        flows[f] = links
        net.add(f, links, 1.0, 0.0)
    assert {f: net.flows[f].rate for f in flows} == _scan_fill(capacity, flows)
