"""Fragments and the sync schedule (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowcomm.config import ConfigError, SyncConfig
from lowcomm.schedule import Schedule, assign_blocks, build_fragments, check_fragments


@settings(max_examples=200, deadline=None)
@given(H=st.integers(1, 60), P=st.integers(1, 12), data=st.data())
def test_every_fragment_sent_every_H_steps(H, P, data):
    P = min(P, H)
    tau = data.draw(st.integers(0, max(0, (H - 1) // P)))
    if tau * P >= H:
        tau = 0
    s = Schedule(H, P, tau)
    sends: dict[int, list[int]] = {p: [] for p in range(P)}
    for t in range(1, 4 * H + 1):
        for p in s.sends_at(t):
            sends[p].append(t)
    for p, steps in sends.items():
        assert steps, f"fragment {p} never sent"
        assert steps[0] <= H
        assert all(b - a == H for a, b in zip(steps, steps[1:]))
        # its result lands before it is sent again
        assert all(s.apply_step(a) < b for a, b in zip(steps, steps[1:]))
    # offsets spread evenly: no two fragments share a step when P <= H
    all_steps = [t for v in sends.values() for t in v]
    assert len(all_steps) == len(set(all_steps))


def test_tau_constraint_is_checked():
    with pytest.raises(ConfigError, match="overlap"):
        SyncConfig(sync_every=10, overlap=5).check_schedule(2)
    SyncConfig(sync_every=10, overlap=4).check_schedule(2)
    SyncConfig(sync_every=10, overlap=10).check_schedule(1)  # CO2's whole-round overlap


def test_fragments_strided_and_sequential():
    assert assign_blocks(6, 3, "strided") == [[0, 3], [1, 4], [2, 5]]
    assert assign_blocks(7, 3, "sequential") == [[0, 1, 2], [3, 4], [5, 6]]
    names = ["embed.weight"] + [f"blocks.{b}.w" for b in range(4)] + ["norm.weight", "head.weight"]
    frags = build_fragments(names, [f"blocks.{b}" for b in range(4)], fragments=3)
    assert frags[0] == ["embed.weight", "norm.weight", "head.weight"]
    assert frags[1] == ["blocks.0.w", "blocks.2.w"] and frags[2] == ["blocks.1.w", "blocks.3.w"]
    assert (
        len(build_fragments(names, [f"blocks.{b}" for b in range(4)], 1, blocks_per_fragment=3))
        == 3
    )
    with pytest.raises(ConfigError, match="blocks"):
        build_fragments(names, [f"blocks.{b}" for b in range(4)], fragments=6)
    check_fragments(frags, names)
    with pytest.raises(ConfigError, match="exactly one"):
        check_fragments([names, ["head.weight"]], names)
    with pytest.raises(ConfigError, match="no fragment"):
        check_fragments([names[:-1]], names)


@pytest.mark.parametrize("H,P,tau", [(10, 1, 0), (6, 2, 0), (7, 3, 1), (12, 5, 2)])
def test_syncs_through_counts_the_steps_that_send(H, P, tau):
    s = Schedule(H, P, tau)
    count = 0
    for t in range(1, 200):
        count += bool(s.sends_at(t))
        assert s.syncs_through(t) == count
