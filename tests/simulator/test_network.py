"""The fluid network against hand-computed max-min fair shares."""

from __future__ import annotations

import pytest

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
