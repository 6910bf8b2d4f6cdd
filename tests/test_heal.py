"""The heal's hand-over on real gloo processes: the shared state goes to the joiners only,
striped across the old members, checked against its digest; where the old members' bytes
differ, it comes whole from the healer."""

from __future__ import annotations

import torch

from lowcomm.elastic import heal
from lowcomm.transport import Transport


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"theta": torch.randn(5000, generator=g), "step": 40, "m": [torch.arange(7)]}


def _hand_over_worker(rank: int, world: int, joiners: list[int], odd: int | None) -> dict:
    t = Transport()
    state = None if rank in joiners else _state(1 if rank == odd else 0)
    record = {"events": [], "members": [0, 1, 2], "last": ["sync@30", 30]}
    before = t.meter.as_dict()
    got, rec, size, sources = heal.hand_over(t, joiners, 0, state, record)
    after = t.meter.as_dict()
    t.close()
    sent = after["control_sent_bytes"] - before["control_sent_bytes"]
    received = after["control_received_bytes"] - before["control_received_bytes"]
    return {"got": got, "rec": rec, "size": size, "sources": sources, "sent": sent,
            "received": received}  # fmt: skip


def test_the_state_goes_to_the_joiner_only_a_third_from_each_old_member(workers):
    res = workers(_hand_over_worker, 4, [3], None)
    want = _state(0)
    joiner = res[3]
    assert heal.digest(joiner["got"]) == heal.digest(want)
    assert joiner["rec"] == {"events": [], "members": [0, 1, 2], "last": ["sync@30", 30]}
    size = joiner["size"]
    assert size == heal.pack(want).numel() and all(r["sources"] == 3 for r in res)
    meta = 3 * 88  # every member's size, digest (and the healer's MAC), gathered (control)
    cuts = [size * i // 3 for i in range(4)]
    record = heal.pack(joiner["rec"]).numel()
    for i, r in enumerate(res[:3]):  # each old member sent its third; the healer the record too
        assert r["received"] == meta  # nothing but the metas: the state went to the joiner only
        assert r["sent"] == meta + cuts[i + 1] - cuts[i] + (record if i == 0 else 0)
    assert joiner["received"] == meta + size + record


def test_old_members_whose_bytes_differ_hand_over_from_the_healer_alone(workers):
    res = workers(_hand_over_worker, 4, [3], 2)
    assert all(r["sources"] == 1 for r in res)
    assert heal.digest(res[3]["got"]) == heal.digest(_state(0))  # the healer's (rank 0)
    assert res[2]["sent"] == 3 * 88  # the odd member sent nothing but its meta


def _small_worker(rank: int, world: int) -> dict:
    """Two joiners (ranks 2, 3) healed by two members from a state of a few bytes' worth."""
    t = Transport()
    state = None if rank >= 2 else {"step": 7}
    got, rec, size, sources = heal.hand_over(t, [2, 3], 0, state, {"events": [1]})
    t.close()
    return {"got": got, "rec": rec, "size": size, "sources": sources}


def test_two_joiners_each_get_every_stripe_and_the_record(workers):
    res = workers(_small_worker, 4)
    for r in res[2:]:
        assert r["got"] == {"step": 7} and r["rec"] == {"events": [1]}
        assert r["sources"] == 2 and r["size"] == heal.pack({"step": 7}).numel()


def _sealed_worker(rank: int, world: int, secrets: list[str]) -> str:
    """A heal from rank 0 to rank 1, each sealing under its own run secret."""
    from lowcomm.elastic.admission import Admission
    from lowcomm.errors import MembershipError

    t = Transport()
    admission = Admission(rank, "run", secrets[rank].encode())

    def seal(digests: bytes) -> bytes:
        return bytes.fromhex(admission.mac("heal", "sync@30", 0, 0, digests.hex()))

    state = None if rank == 1 else _state(0)
    try:
        got, _, _, _ = heal.hand_over(t, [1], 0, state, {"events": []}, seal)
        return "healed" if rank == 0 or torch.equal(got["theta"], _state(0)["theta"]) else "wrong"
    except MembershipError as e:
        return str(e)
    finally:
        t.close()


def test_a_heal_is_loaded_only_under_a_valid_mac_of_the_healer(workers):
    """The healer's MAC covers the digests of the state and the record: a joiner under the
    same secret loads them; under another (a forged healer, or a stranger's) it refuses them."""
    assert workers(_sealed_worker, 2, ["s", "s"]) == ["healed", "healed"]
    got = workers(_sealed_worker, 2, ["s", "forged"])
    assert got[0] == "healed" and "no valid MAC" in got[1], got
