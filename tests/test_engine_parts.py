"""The engine's parts are one typed value it owns (``LowComm.parts``), and the run state says
what a worker starting afresh loads and which parts are model-sized, so no caller names them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowcomm.engine.state import CARRIED, RunState, StatePart
from lowcomm.engine.wiring import Parts


def test_afresh_replaces_only_the_parts_that_declare_a_fresh_value():
    state = RunState()
    state.register("kept", StatePart(lambda: 1, lambda v: None))
    state.register("dropped", StatePart(lambda: {"x": 1}, lambda v: None, fresh={}))
    state.register("none", StatePart(lambda: 2, lambda v: None, fresh=None))
    sd = {"kept": 1, "dropped": {"x": 1}, "none": 2}
    assert state.afresh(sd) == {"kept": 1, "dropped": {}, "none": None}
    assert sd["dropped"] == {"x": 1}  # the caller's dict is left as it was
    assert StatePart(lambda: 0, lambda v: None).fresh is CARRIED


def _started(rank: int, world: int) -> dict:
    from helpers import adamw, tiny_model

    from lowcomm.engine import LowComm

    torch.manual_seed(0)
    model = tiny_model()
    sync = LowComm(model, adamw(model), sync_every=2, compensation="ef", codec="int8")
    before = set(vars(sync))
    with sync:
        parts = sync.parts
        out = {
            "new_attributes": sorted(set(vars(sync)) - before),
            "same": [
                sync.transport is parts.transport,
                sync.aggregator is parts.aggregator,
                sync.compensation is parts.compensation,
                sync.fragments is parts.fragments,
                sync.membership is None,
            ],
            "fresh": sorted(k for k, v in sync.state.afresh({}).items()),
            "buffers": sync.state.names(buffer=True),
        }
    return out


def test_the_engine_assigns_its_parts_itself_and_names_what_a_new_world_resets(workers):
    for r in workers(_started, 2):
        # only the engine's own slots change on entering (its parts, hook and flags)
        assert r["new_attributes"] == [], r["new_attributes"]
        assert all(r["same"])
        # what a resume on another number of workers resets (the trainer once listed these)
        assert r["fresh"] == sorted(
            ["pending", "compensation", "left_out", "local", "snapshot", "reduce_compensation"]
        )
        assert r["buffers"] == [
            "global", "snapshot", "outer", "compensation", "reduce_compensation", "pending",
        ]  # fmt: skip


def test_parts_are_frozen():
    assert dataclasses.fields(Parts) and Parts.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_a_replayed_leave_on_the_comm_thread_ends_the_site_at_its_next_step():
    """A replayed leave raised inside an overlapped exchange (the comm thread) reaches the
    trainer at the next step, when the engine asks what is due, not when the result falls due
    later (before, the protocol ended the process with os._exit from the comm thread)."""
    from concurrent.futures import Future

    from lowcomm.engine.state import RunState
    from lowcomm.engine.sync import InFlight, Pending
    from lowcomm.errors import SiteLeft

    inflight = InFlight(None, RunState())  # type: ignore[arg-type]
    fine: Future = Future()
    inflight.pending[0] = Pending(fine, sent_at=10, apply_at=20)
    assert inflight.due(11, []) == []  # still running: nothing due
    left: Future = Future()
    left.set_exception(SiteLeft("sync@10"))
    inflight.pending[1] = Pending(left, sent_at=10, apply_at=20)
    with pytest.raises(SiteLeft):
        inflight.due(11, [])


def test_a_result_in_flight_keeps_what_the_payloads_told_and_the_layout_of_before():
    """A result saved in flight (a checkpoint, a heal) keeps a worker's NaN found only by the
    payloads' flags, and where none was found the entry is as it was before those flags: no
    new keys, control flags without the validity columns (the pins hash checkpoints)."""
    from lowcomm.aggregate.base import Reduced
    from lowcomm.engine.sync import Event, _entry, _pending_from, flags_row, without_validity

    rows = [flags_row(8, False, False, [3, 0], [1, -1]), flags_row(8, True, False, [2, 0], [1, 0])]
    flags = without_validity(torch.stack(rows))
    assert flags.tolist() == [[0, 8, 0, 3, 0], [1, 8, 0, 2, 0]]
    clean = _entry(0, Event(flags, {0: Reduced(torch.ones(4), 2)}), 8, 9)
    assert "nonfinite" not in clean and "left_out" not in clean
    told = Reduced(torch.ones(4), 1, nonfinite=(1,), left_out_here=True)
    entry = _entry(0, Event(flags, {0: told}), 8, 9)
    back = _pending_from(0, entry).future.result()
    assert back.reduced[0].nonfinite == (1,) and back.reduced[0].left_out_here
    assert back.nonfinite_workers == 1 and torch.equal(back.flags, flags)
    assert not _pending_from(0, clean).future.result().reduced[0].left_out_here


def test_workers_left_out_are_counted_once_whether_their_flags_or_payloads_told():
    """One exchange of two fragments: worker 2 found its NaN first (its control flag),
    workers 0 and 1 each only through its payload of one fragment: three workers, not the
    most of any one fragment (two)."""
    from lowcomm.aggregate.base import Reduced
    from lowcomm.engine.sync import Event, flags_row, without_validity

    rows = [flags_row(8, False, w == 2, [4, 4], [-1, -1]) for w in range(4)]
    flags = without_validity(torch.stack(rows))
    told = {0: (0,), 1: (1,)}
    event = Event(flags, {p: Reduced(torch.ones(2), 1, nonfinite=w) for p, w in told.items()})
    assert event.nonfinite_workers == 3
    assert Event(flags, {p: Reduced(torch.ones(2), 3) for p in (0, 1)}).nonfinite_workers == 1


# --- the extension points: hooks on a sync, and the transport factory -------------------------


def test_sync_hooks_run_in_order_and_come_off_by_their_handle():
    from lowcomm.protocols import CommitVote, Contribution, SyncHooks

    hooks, seen = SyncHooks(), []
    c = Contribution(3, [torch.ones(2)], [torch.zeros(2)])
    assert hooks.contribution(c) is c and c.compensate  # nothing registered: nothing happens
    first = hooks.register_contribution_hook(lambda c: seen.append(("first", c.step)))

    def second(c):
        c.tensors[0].mul_(2)
        c.compensate = False

    hooks.register_contribution_hook(second)
    hooks.contribution(c)
    assert seen == [("first", 3)] and torch.equal(c.tensors[0], torch.full((2,), 2.0))
    assert not c.compensate
    first.remove()
    hooks.contribution(Contribution(4, [torch.ones(2)], []))
    assert seen == [("first", 3)]
    vote = CommitVote("sync@4", True, None, (0, 1))
    hooks.register_vote_hook(lambda v: None)  # None: the vote as it is
    assert hooks.vote(vote) == vote
    hooks.register_vote_hook(lambda v: dataclasses.replace(v, ok=False))
    assert not hooks.vote(vote).ok
    hooks.register_checksum_hook(lambda value: None)
    assert hooks.checksum(7) == 7
    hooks.register_checksum_hook(lambda value: value + 1)
    assert hooks.checksum(7) == 8


def _factory_run(rank: int, world: int, counted: bool) -> dict:
    """12 DiLoCo steps (H = 4); ``counted``: every transport made by a factory that wraps it
    and counts the training all-reduces it carries."""
    from helpers import adamw, batches, local_steps, tiny_model

    import lowcomm
    from lowcomm.transport import Transport, TransportWrapper

    calls = []

    class Counting(TransportWrapper):
        def all_reduce(self, t, control=False, op="sum"):
            calls.append(control)
            return self.inner.all_reduce(t, control, op)

    made = (lambda group, meter: Counting(Transport(group, meter))) if counted else Transport
    model = tiny_model(seed=0)
    opt, data = adamw(model), batches(rank, world)
    sync = lowcomm.DiLoCo(model, opt, sync_every=4, transports=made)
    with sync:
        local_steps(model, opt, data, 12)
    return {"global": sync.global_flat(), "training": calls.count(False), "syncs": sync.stats.syncs}


def test_a_transport_factory_makes_every_transport_the_engine_uses(workers):
    plain = workers(_factory_run, 2, False)
    counted = workers(_factory_run, 2, True)
    for a, b in zip(plain, counted):
        assert torch.equal(a["global"], b["global"])  # a wrapper that only counts moves nothing
        # each sync's all-reduce of the pseudo-gradient and of the buffers, and the exit's
        assert b["syncs"] == 3 and b["training"] >= 3, b
