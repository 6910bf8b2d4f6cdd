"""Attack faults: read from the one fault grammar, and acted out by the bad site on what it
sends (in place, before encoding)."""

from __future__ import annotations

import pytest
import torch

from lowcomm.aggregate import encode_tensors
from lowcomm.errors import ConfigError
from lowcomm.lab.faults import Fault, parse_faults
from lowcomm.lab.faults.harness import Harness
from lowcomm.protocols import CommitVote, Contribution, SyncHooks
from lowcomm.transport import Transport


def harness(spec: str, site: int, sites: int = 2, step: int = 1) -> Harness:
    """Site ``site``'s harness for ``spec``, acted up to ``step``."""
    h = Harness(parse_faults(spec, sites, 100), site)
    for s in range(1, step + 1):
        h.act(s)
    return h


def contribute(h: Harness, tensors: list, step: int, weights: list | None = None) -> bool:
    """``h``'s contribution hook on ``tensors`` (in place): whether it goes through the
    compensation."""
    c = Contribution(step, tensors, weights or [])
    h.contribution(c)
    return c.compensate


def voted(h: Harness, tag: str, members: list[int]) -> tuple[bool, object]:
    """The vote ``h`` casts on an attempt of ``tag`` whose collectives completed."""
    hooks = SyncHooks()
    hooks.register_vote_hook(h.vote)
    v = hooks.vote(CommitVote(tag, True, None, tuple(members)))
    return v.ok, v.blame


def reported(h: Harness, value: int) -> int:
    """The replica checksum ``h`` reports for a global copy whose true checksum is ``value``."""
    hooks = SyncHooks()
    hooks.register_checksum_hook(h.checksum)
    return hooks.checksum(value)


def test_attacks_are_read_from_the_fault_grammar():
    got = parse_faults("signflip:1@20,scale:2x1000,noise:0x2,zero:3,nan:1@5", 4, 100)
    assert got == [Fault("signflip", 1, 20), Fault("scale", 2, 1, 1000.0),
                   Fault("noise", 0, 1, 2.0), Fault("zero", 3, 1), Fault("nan", 1, 5)]  # fmt: skip
    for bad, why in [("scale:1", "needs xFACTOR > 0"), ("noise:1x0", "needs xFACTOR > 0"),
                     ("signflip:1x2", "takes no xFACTOR"), ("alie:1x2", "takes no xFACTOR"),
                     ("zero:9", "names site 9")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why) as info:
            parse_faults(bad, 4, 100)
        assert "\n" not in str(info.value)


def test_a_site_attacks_from_its_step_on_and_only_itself():
    planned = parse_faults("scale:1@3x10", 4, 100)
    other, bad = Harness(planned, 0), Harness(planned, 1)
    x = [torch.ones(4)]
    other.act(3)  # another site's fault: this one sends as it is
    bad.act(2)  # not yet
    assert contribute(other, x, 3) and contribute(bad, x, 2)
    assert torch.equal(x[0], torch.ones(4))
    bad.act(3)
    for step in (3, 4, 50):
        x = [torch.ones(4), torch.full((2,), -2.0)]
        assert contribute(bad, x, step)  # its compensation stays
        assert torch.equal(x[0], torch.full((4,), 10.0)) and torch.equal(
            x[1], torch.full((2,), -20.0)
        )


def test_a_harness_without_faults_wraps_nothing_and_hooks_nothing():
    h = Harness([], 0)
    assert h.transports(Transport) is Transport
    hooks = SyncHooks()

    class Engine:  # what the harness would register its hooks on
        register_contribution_hook = hooks.register_contribution_hook
        register_vote_hook = hooks.register_vote_hook
        register_checksum_hook = hooks.register_checksum_hook

    h.on_engine(Engine())
    x = [torch.ones(4)]
    assert hooks.contribution(Contribution(1, x, [])).compensate
    assert torch.equal(x[0], torch.ones(4)) and hooks.checksum(7) == 7


def test_a_nan_attack_skips_its_own_compensation():
    x = [torch.ones(3)]
    assert not contribute(harness("nan:0", 0), x, 1)
    assert bool(torch.isnan(x[0]).all())


@pytest.mark.parametrize(("spec", "check"), [
    ("signflip:0", lambda x, y: torch.equal(y, -x)),
    ("zero:0", lambda x, y: not y.any()),
    ("nan:0", lambda x, y: bool(torch.isnan(y).all())),
    ("noise:0x2", lambda x, y: 1.8 < float((y - x).norm() / x.norm()) < 2.2),
])  # fmt: skip
def test_each_attack_does_what_it_says(spec, check):
    h = harness(spec, 0)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    contribute(h, [y], 7)
    assert check(x, y)


def test_drift_shrinks_every_weight_on_a_half_of_its_own_and_colluders_share_every_entry():
    """drift: the global weights (the merge subtracts it: every weight shrinks to 0), at the
    contribution's own norm, on a fixed half of the entries per site; collude: on every entry,
    the same for all colluders. Neither keeps its buffers."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=gen)
    x, y = torch.randn(4096, generator=gen), 3 * torch.randn(4096, generator=gen)
    sent = {}
    for name, spec, t, step in [("a7", "drift:1", x, 7), ("a9", "drift:1", y, 9),
                                ("b", "drift:2", x, 7), ("c", "collude:1x2", x, 7),
                                ("d", "collude:5", y, 3)]:  # fmt: skip
        h = harness(spec, int(spec.split(":")[1][0]), sites=8)
        sent[name] = t.clone()
        assert not contribute(h, [sent[name]], step, [w])
    a, b = sent["a7"] != 0, sent["b"] != 0
    assert torch.equal(a, sent["a9"] != 0) and 0.45 < float(a.float().mean()) < 0.55
    assert 0.2 < float((a & b).float().mean()) < 0.3  # two drifting sites: halves of their own
    assert bool((sent["a7"][a] * w[a] > 0).all())  # the weights: the merge shrinks them
    assert torch.allclose(sent["a9"].norm(), y.norm())
    assert torch.allclose(sent["c"].norm(), 2 * x.norm())
    cos = torch.nn.functional.cosine_similarity
    assert float(cos(sent["c"], w, dim=0)) > 0.9999 < float(cos(sent["d"], w, dim=0))


def test_an_insider_lies_in_its_votes_and_checksum_from_its_step_and_only_itself():
    members = [0, 1, 2, 3]
    for spec, vote, checksum in [
        ("accuse:2@5", (False, (0, "payload from worker 0 has validity flag 127")), 77),
        ("dissent:2@5", (False, None), 77),
        ("liar:2@5", (True, None), 12345),
    ]:
        early, h, other = harness(spec, 2, 4, 4), harness(spec, 2, 4, 5), harness(spec, 1, 4, 9)
        assert voted(early, "sync@10", members) == (True, None) == voted(other, "sync@10", members)
        assert voted(h, "sync@10", members) == vote
        assert voted(h, "flags@10", members) == (True, None)  # syncs only
        assert reported(h, 77) == checksum and reported(other, 77) == reported(early, 77) == 77
    accuser = harness("accuse:0@1", 0, 4)  # names the lowest member but itself
    assert voted(accuser, "sync@10", members)[1][0] == 1


def test_noise_is_the_same_in_a_replay():
    h = harness("noise:0x1", 0)
    a, b = [torch.ones(64)], [torch.ones(64)]
    contribute(h, a, 9)
    contribute(h, b, 9)
    c = [torch.ones(64)]
    contribute(h, c, 10)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_the_attack_matrix_reads_each_cell_against_the_clean_plain_run():
    from lowcomm.lab.bench.attacks import table

    def row(rule, attack, bad, loss, **kw):
        return {"strategy": "diloco", "seed": 0, "rule": rule, "attack": attack, "bad": bad,
                "loss": loss, **kw}  # fmt: skip

    rows = [row("auto", "none", 0, 2.0), row("norm-clip", "none", 0, 2.01),
            row("auto", "scale", 2, 9.0), row("norm-clip", "scale", 2, 2.05),
            row("auto", "nan", 2, None), row("median", "nan", 2, None, refused=True)]  # fmt: skip
    text = table(rows, diverged=1.5)
    assert "clean, plain rule: 2.0" in text
    assert "| none | 0 | 1.000 | 1.005 |  |" in text
    assert "| scale | 2 | 4.500 diverged | 1.025 |  |" in text
    assert "| nan | 2 | stopped |  | refused |" in text


def _gather_fp32():
    from lowcomm.aggregate.factory import aggregator_for
    from lowcomm.codecs import make_codec

    return aggregator_for("gather", make_codec("fp32"), 4)


def _engine(agg, *shapes: list[torch.Size]):
    """What a forger reads of its engine: the aggregator, and one fragment of one bucket per
    entry of ``shapes``."""
    from types import SimpleNamespace

    frags = [
        SimpleNamespace(buckets=[list(range(len(s)))], params=[torch.empty(d) for d in s])
        for s in shapes
    ]
    return SimpleNamespace(aggregator=agg, fragments=frags)


def test_copy_sends_another_sites_last_payload_byte_for_byte():
    agg, shapes = _gather_fp32(), [torch.Size([3]), torch.Size([2])]
    h = harness("copy:1", 1, sites=4)
    h.engine = _engine(agg, shapes, shapes)  # two fragments of the same shapes
    first, second = ((0,), 0), ((1,), 0)  # fragment 0's only payload, and fragment 1's
    mine = encode_tensors(agg, [torch.ones(3), torch.ones(2)]).payload
    assert torch.equal(h.forged(mine, 1, first), mine)  # nothing seen: honest
    rows = [encode_tensors(agg, [torch.full((3,), float(r)), torch.zeros(2)], valid=r != 0).payload
            for r in range(4)]  # fmt: skip
    h.gathered(rows, first)
    # site 0 sent nothing valid: the first other valid sender is site 2
    assert torch.equal(h.forged(mine, 1, first), rows[2])
    # payloads are told apart by their sync's fragments: the other one saw nothing yet
    assert torch.equal(h.forged(mine, 1, second), mine)


def test_alie_sends_the_honest_mean_minus_z_times_their_spread():
    import statistics

    import numpy as np

    from lowcomm.lab.faults import forge

    # Baruch et al.: n = 8, m = 2: s = 3, z = Phi^-1(5/8)
    assert forge.alie_z(8, 2) == pytest.approx(statistics.NormalDist().inv_cdf(5 / 8))
    assert forge.alie_z(8, 1) == pytest.approx(0.0)
    agg, shapes = _gather_fp32(), [torch.Size([5]), torch.Size([2, 2])]
    h = harness("alie:2,alie:3", 3, sites=4)
    h.engine, key = _engine(agg, shapes), ((0,), 0)
    g = torch.Generator().manual_seed(0)
    sent = [torch.randn(9, generator=g) for _ in range(4)]
    h.gathered([encode_tensors(agg, [x[:5], x[5:].reshape(2, 2)]).payload for x in sent], key)
    mine = encode_tensors(agg, [torch.zeros(5), torch.zeros(2, 2)]).payload
    got = agg.codec.plan(shapes, torch.device("cpu")).decode(h.forged(mine, 3, key))[1]
    honest = np.stack([sent[0].numpy(), sent[1].numpy()])  # sites 2 and 3 collude
    want = honest.mean(0) - forge.alie_z(4, 2) * honest.std(0, ddof=1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


# every attack of the grammar on site 3 of 4 (noise strong enough to harm a plain mean), and
# alie by sites 2 and 3 (one alone has z = 0: it would send the honest mean)
REAL = ("signflip:3", "scale:3x1000", "noise:3x10", "zero:3", "nan:3", "copy:3", "alie:2,alie:3")
# three syncs (H = 2) of each run: the attacked sends are merged (or refused) at every one; 12
# steps gave the same pass or fail on every measure below, with as wide margins, at twice the time
STEPS = 6


def _attacked_runs(rank: int, world: int, rule: str) -> dict:
    """The same STEPS steps (DiLoCo, H = 2, on gather) clean and under each attack of ``REAL``:
    each run's final global copy, or None where the run stopped."""
    from helpers import adamw, batches, tiny_model

    import lowcomm

    out = {}
    for spec in ("", *REAL):
        planned = parse_faults(spec, world, STEPS)
        h = Harness(planned, rank)
        model = tiny_model(seed=0)
        opt = adamw(model)
        data = batches(rank, world)
        sync = lowcomm.DiLoCo(model, opt, sync_every=2, outer_lr=0.7, aggregation=rule,
                              reduce="gather", nonfinite_patience=1,
                              transports=h.transports(Transport))  # fmt: skip
        h.on_engine(sync)  # the harness, handed to the engine as the trainer does
        try:
            with sync:
                for step in range(1, STEPS + 1):
                    h.on_step_begin(step)
                    x, y = data.next()
                    model(x, y).backward()
                    opt.step()
                    opt.zero_grad()
            out[spec] = sync.global_flat().clone()
        except Exception:  # a NaN merged into the model stops the run (every site alike)
            out[spec] = None
    out["start"] = torch.cat([p.detach().reshape(-1) for p in tiny_model(seed=0).parameters()])
    return out


RULES = ["mean", "median", "trimmed-mean", "centered-clip", "norm-clip", "cosine-clip"]


def _every_rule(rank: int, world: int) -> dict:
    return {rule: _attacked_runs(rank, world, rule) for rule in RULES}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory) -> list[dict]:
    """Every rule's runs (by rank), from one start of the 4 workers: each rule's test reads its
    own (a start of 4 processes, ~1.7 s on 2 cores, paid once instead of per rule)."""
    from conftest import run_workers

    return run_workers(_every_rule, 4, tmp_path=tmp_path_factory.mktemp("attacks"))


@pytest.mark.parametrize("rule", RULES)
def test_each_attack_harms_the_plain_mean_and_each_robust_rule_bounds_it(attacked, rule):
    """On 4 real gloo processes, site 3 acting out every attack in turn: with the plain mean a
    x1000 or strong noise moves the model many times as far as the whole clean run did, and a
    NaN stops it; under each robust rule no attack by one site moves it as far as the clean run
    moved (two colluding alie sites of four are half the run: they finish, alike everywhere)."""
    runs = [r[rule] for r in attacked]
    clean = runs[0][""]
    for r in runs:  # every site holds the same model, attacked or not
        for spec in ("", *REAL):
            assert (r[spec] is None) == (runs[0][spec] is None), spec
            assert r[spec] is None or torch.equal(r[spec], runs[0][spec]), spec
    moved = float((clean - runs[0]["start"]).norm())
    off = {s: None if runs[0][s] is None else float((runs[0][s] - clean).norm()) / moved
           for s in REAL}  # fmt: skip
    if rule == "mean":
        assert off["scale:3x1000"] > 50 and off["noise:3x10"] > 1, off
        assert off["nan:3"] is None, off
    else:
        alone = {s: v for s, v in off.items() if not s.startswith("alie")}
        assert all(v is not None and v < 1 for v in alone.values()), off
    assert off["alie:2,alie:3"] is not None, off
