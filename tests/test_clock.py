"""The trainer's clock: compute never exceeds wall, whatever the meters say, across resumes."""

from __future__ import annotations

import pytest

from lowcomm.train import run as run_mod


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_segments_split_wall_into_compute_and_waiting(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(run_mod.time, "perf_counter", fake.perf_counter)
    blocked = [0.0]
    clock = run_mod.Clock()
    with clock.segment(lambda: blocked[0]):  # 2 s, of which the meter saw 0.5 s waiting
        fake.now += 2.0
        blocked[0] += 0.5
    fake.now += 7.0  # logging / evaluation / checkpoint: not counted
    with clock.segment(lambda: blocked[0]) as extra:
        fake.now += 1.0  # 1 s, 0.25 s waiting seen only by the caller
        extra.append(0.25)
    assert clock.wall_s == pytest.approx(3.0)
    assert clock.compute_s == pytest.approx(3.0 - 0.5 - 0.25)
    assert clock.blocked_extra == pytest.approx(0.25)


def test_waiting_beyond_the_segment_is_clamped(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(run_mod.time, "perf_counter", fake.perf_counter)
    blocked = [0.0]
    clock = run_mod.Clock()
    with clock.segment(lambda: blocked[0]):
        fake.now += 1.0
        blocked[0] += 5.0  # a background thread's wait, longer than the segment itself
    assert clock.compute_s == 0.0 and clock.wall_s == pytest.approx(1.0)


def test_resumed_clock_continues_and_stays_consistent(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(run_mod.time, "perf_counter", fake.perf_counter)
    first = run_mod.Clock()
    with first.segment(lambda: 0.0):
        fake.now += 4.0
    saved = first.state_dict()
    fake.now += 60.0  # the run was down, then restarted: none of this is training time
    resumed = run_mod.Clock()
    resumed.load_state_dict(saved)
    with resumed.segment(lambda: 0.0):
        fake.now += 1.0
    assert resumed.wall_s == pytest.approx(5.0) and resumed.compute_s == pytest.approx(5.0)
    # a checkpoint from before this fix could hold compute > wall: read back clamped
    resumed.load_state_dict({"wall": 2.0, "compute": 2.2, "blocked_extra": 0.0})
    assert resumed.compute_s <= resumed.wall_s


def test_the_syncs_own_work_counts_as_not_computing(monkeypatch):
    """Utilization's one definition: encode, decode, outer step and merge on the training
    thread are not compute, nor is a compressing DDP hook's encode; only inner steps are."""
    from types import SimpleNamespace

    fake = FakeTime()
    monkeypatch.setattr(run_mod.time, "perf_counter", fake.perf_counter)
    stats = SimpleNamespace(outer_s=0.0)
    waits = [0.0]
    run = SimpleNamespace(
        engine=SimpleNamespace(stats=stats), hook_state=None, blocked_s=lambda: waits[0]
    )  # a Comm as the clock sees it
    clock = run_mod.Clock()
    with clock.segment(lambda: run_mod.Comm.not_computing_s(run)):
        fake.now += 2.0
        stats.outer_s += 0.3  # the engine encoded, decoded, stepped and merged for 0.3 s
        waits[0] += 0.2  # and waited on the network for 0.2 s
    assert clock.compute_s == pytest.approx(1.5) and clock.wall_s == pytest.approx(2.0)
    hook = SimpleNamespace(work_s=0.0)
    run = SimpleNamespace(engine=None, hook_state=hook, blocked_s=lambda: 0.0)
    with clock.segment(lambda: run_mod.Comm.not_computing_s(run)):
        fake.now += 1.0
        hook.work_s += 0.25  # LoCo's hook compressing gradients during backward
    assert clock.compute_s == pytest.approx(1.5 + 0.75)
