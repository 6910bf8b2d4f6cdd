"""Transport: collectives move what they should and the meter counts the ring cost."""

from __future__ import annotations

import torch

from lowcomm.transport import Transport


def _collectives_worker(rank: int, world: int) -> dict:
    t = Transport()
    out = {}
    x = torch.full((10,), float(rank + 1))
    out["all_reduce"] = t.all_reduce(x.clone())
    m0 = t.meter.as_dict()
    out["all_gather"] = t.all_gather(torch.full((3,), rank, dtype=torch.uint8))
    m1 = t.meter.as_dict()
    chunks = [torch.full((4,), 10 * rank + j, dtype=torch.int32) for j in range(world)]
    out["all_to_all"] = t.all_to_all(chunks)
    m2 = t.meter.as_dict()
    fut = t.submit(lambda: t.all_reduce(torch.ones(5)))
    out["async"] = t.wait(fut)
    b = torch.full((6,), float(rank))
    t.broadcast(b, src=0)
    out["broadcast"] = b
    out["meters"] = [m0, m1, m2, t.meter.as_dict()]
    t.close()
    return out


def test_collectives_and_byte_meter(workers):
    world = 3
    res = workers(_collectives_worker, world)
    for rank, r in enumerate(res):
        assert torch.equal(r["all_reduce"], torch.full((10,), 6.0))
        assert [int(g[0]) for g in r["all_gather"]] == [0, 1, 2]
        assert [int(c[0]) for c in r["all_to_all"]] == [10 * j + rank for j in range(world)]
        assert torch.equal(r["async"], torch.full((5,), 3.0))
        assert torch.equal(r["broadcast"], torch.zeros(6))
        m0, m1, m2, m3 = r["meters"]
        # all-reduce of 40 bytes: payload 40, wire 2(M-1)/M * 40
        assert m0["payload_bytes"] == 40 and m0["sent_bytes"] == round(2 * 2 / 3 * 40)
        # all-gather of 3 bytes: (M-1) * 3 each way
        assert m1["payload_bytes"] - m0["payload_bytes"] == 3
        assert (
            m1["sent_bytes"] - m0["sent_bytes"] == 6
            and m1["received_bytes"] - m0["received_bytes"] == 6
        )
        # all-to-all of 3 x 16 bytes: (M-1)/M of the input
        assert m2["payload_bytes"] - m1["payload_bytes"] == 48
        assert m2["sent_bytes"] - m1["sent_bytes"] == 32
        # the broadcast is control traffic, not training traffic
        assert m3["control_sent_bytes"] == round(2 / 3 * 24)
        assert m3["collectives"] == 4


def test_an_exchanges_result_tensors_are_all_found_for_the_callers_stream():
    """On a GPU the comm thread's results are recorded on the caller's stream (transport.
    _on_side_stream): every tensor in one, at any depth of dataclasses, dicts, lists, tuples."""
    from lowcomm.aggregate import Reduced
    from lowcomm.engine.sync import Event
    from lowcomm.transport import tensors_in

    a, b, c, d = (torch.zeros(1) for _ in range(4))
    event = Event(a, {0: Reduced(b, 2, [c, (d, a)], {1: 2.0})}, None)
    assert [id(t) for t in tensors_in(event)] == [id(a), id(b), id(c), id(d), id(a)]
    assert list(tensors_in(("x", 3, None))) == []
