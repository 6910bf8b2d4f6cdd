"""Quorum rounds: no site waits for the slowest (real processes on torchft's lighthouse).

A sync closes once ``quorum`` sites reached it plus a grace window; a slower site cuts its round
short and its pseudo-gradient is weighted by the inner steps it holds; a site that misses a sync
carries its work into its next one (or drops it). Checked against an independent computation of
each sync's weighted merge from what every site held just before it.
"""

from __future__ import annotations

import math

import pytest
import rounds_site
import torch
from conftest import SiteProcess

pytest.importorskip("torchft")

STEPS = 20
OUTER = {"sync_every": 5, "outer_optimizer": "sgd", "outer_lr": 0.7}  # no outer state to track


def _lighthouse(join_s: float):
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=int(join_s * 1000), quorum_tick_ms=20,
        heartbeat_timeout_ms=2_000,
    )  # fmt: skip


@pytest.fixture
def lighthouse():
    """A lighthouse as quorum rounds want it: it gathers the sites asking within a moment
    of each other, not every live one (lowcomm's launcher starts it so)."""
    from lowcomm.elastic.rounds import LIGHTHOUSE_JOIN_S

    server = _lighthouse(LIGHTHOUSE_JOIN_S)
    yield server.address()
    server.shutdown()


def _run(
    tmp_path, lighthouse, rounds, step_s=(0.0, 0.0, 0.0), preset="DiLoCo", kw=None, steps=STEPS
):  # fmt: skip
    """Three sites of one run; each site's saved record."""
    procs = []
    for i in range(3):
        args = dict(index=i, sites=3, lighthouse=lighthouse, out=str(tmp_path), preset=preset,
                    kw=kw or OUTER, steps=steps, rounds=rounds, step_s=step_s[i])  # fmt: skip
        procs.append(SiteProcess(rounds_site.site, args, tmp_path, hard_exit=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    sites = [torch.load(tmp_path / f"site{i}.pt", weights_only=False) for i in range(3)]
    for i, s in enumerate(sites):  # only a slow site may stop alone, at the run's end
        assert not s["stopped"] or step_s[i] > 0, s["stopped"]
    return sites


_RULES = {"steps": lambda h: float(h), "plain": lambda h: 1.0, "normalized": lambda h: 1.0 / h}


def _merge_checked(sites: list[dict], lr: float, drop: bool = False, rule: str = "steps") -> int:
    """Every sync recomputed from what each site held just before it: the global copy moves by
    ``-lr`` times the mean of the contributions (each site's global minus its local weights)
    weighted by ``rule`` of the inner steps h each holds (h, 1 or 1/h; the plain mean when all
    hold the same); a site that missed a sync contributes against its own (older) global copy
    (carry) or not at all (drop). Returns how many syncs had unequal steps (the weighting was
    exercised)."""
    steps = sorted({s["step"] for site in sites for s in site["syncs"]})
    uneven = 0
    for step in steps:
        held = [s for site in sites for s in site["syncs"] if s["step"] == step]
        after = held[0]["after"]
        for s in held:
            assert torch.equal(s["after"], after), f"sites disagree after sync@{step}"
        # the run's global copy: the one most sites hold (a site back from a missed sync
        # holds an older one)
        newest = max((s["glob"] for s in held),
                     key=lambda g: sum(torch.equal(g, s["glob"]) for s in held))  # fmt: skip
        parts, steps_held = [], []
        for s in held:
            behind = not torch.equal(s["glob"], newest) and drop
            h = 0 if behind else s["covered"]
            steps_held.append(h)
            parts.append((_RULES[rule](h) if h > 0 else 0.0, s["glob"] - s["local"]))
        total = sum(w for w, _ in parts)
        mean = sum(w * d for w, d in parts) / total
        uneven += len({h for h in steps_held if h > 0}) > 1
        glob = next(s["glob"] for s in held if torch.equal(s["glob"], newest))
        torch.testing.assert_close(after, glob - lr * mean, rtol=0, atol=2e-6)
        if len({h for h in steps_held if h > 0}) > 1:  # the check would catch each other rule
            for other in set(_RULES) - {rule}:
                w = [_RULES[other](h) if h > 0 else 0.0 for h in steps_held]
                alt = sum(wi * d for wi, (_, d) in zip(w, parts)) / sum(w)
                assert not torch.allclose(after, glob - lr * alt, rtol=0, atol=2e-6), other
    return uneven


def test_equal_sites_in_quorum_rounds_give_lockstep_bit_for_bit(tmp_path, lighthouse):
    (tmp_path / "lock").mkdir()
    (tmp_path / "quorum").mkdir()
    server = _lighthouse(30.0)  # lock-step's: it waits for every live site
    try:
        lock = _run(tmp_path / "lock", server.address(), {})
    finally:
        server.shutdown()
    # every site inside a generous grace window: each does its full H steps
    quorum = _run(tmp_path / "quorum", lighthouse, {"rounds": "quorum", "quorum": 2, "grace": 30})
    assert all(s["trained"] == STEPS and s["cut"] == 0 and s["late"] == 0 for s in quorum)
    for a, b in zip(lock, quorum):
        assert torch.equal(a["global"], b["global"])
        assert a["shared"] == b["shared"]


@pytest.mark.parametrize(
    "rule", ["steps", pytest.param("plain", marks=pytest.mark.slow), "normalized"]
)
def test_a_slow_site_is_not_waited_for_and_is_weighted_by_the_rule(tmp_path, lighthouse, rule):
    sites = _run(tmp_path, lighthouse, {"rounds": "quorum", "quorum": 2, "weighting": rule},
                 step_s=(0.0, 0.12, 0.0))  # fmt: skip
    slow, fast = sites[1], [sites[0], sites[2]]
    # the fast sites did every step; the slow one cut rounds short (auto grace: it goes to the
    # sync at its next step boundary). Whether it is ever late too depends on how the host
    # schedules it (a stall longer than the grace window): timing, not asserted here
    assert all(s["trained"] == STEPS for s in fast)
    assert 0 < slow["trained"] < STEPS and slow["cut"] >= 1
    assert len({s["shared"] for s in sites}) == 1
    # every sync checked against the independent weighted merge; some weighted unevenly
    assert _merge_checked(sites, OUTER["outer_lr"], rule=rule) >= 1


# drop by hand (-m slow): its path differs from carry's only in what the heal loads
@pytest.mark.parametrize("late", ["carry", pytest.param("drop", marks=pytest.mark.slow)])
def test_a_late_site_carries_its_work_into_its_next_sync_or_drops_it(tmp_path, lighthouse, late):
    # a grace window shorter than the slow site's step: it misses syncs, then asks back in
    rounds = {"rounds": "quorum", "quorum": 2, "grace": 0.01, "late": late}
    sites = _run(tmp_path, lighthouse, rounds, step_s=(0.0, 0.25, 0.0))
    slow = sites[1]
    assert slow["late"] >= 1, "the slow site was never late: the test did not test lateness"
    # late for the run's last sync too, it may stop alone as it leaves (docs/reliability.md)
    assert not slow["stopped"] or "stops here; the others go on" in slow["stopped"]
    assert len({s["shared"] for s in sites}) == 1
    _merge_checked(sites, OUTER["outer_lr"], drop=late == "drop")
    joined = [e for e in sites[0]["events"] if 1 in e.get("joined", [])]
    assert joined, "the late site's return is not in the membership record"


# -- every method under quorum rounds ------------------------------------------------------------
# Each method's own settings, on the tiny model; Streaming on an FP32 wire (its FP4 codec is
# checked elsewhere) so that its reference is exact plain torch.
METHODS = {
    "streaming": ("StreamingDiLoCo", {"sync_every": 6, "fragments": 2, "blocks_per_fragment": 0,
                                      "overlap": 1, "codec": "fp32"}),
    "sparseloco": ("SparseLoCo", {"sync_every": 5, "density": 1 / 16}),
    "co2": ("CO2", {"sync_every": 5, "outer_momentum": 0.0}),
}  # fmt: skip
METHOD_STEPS = 18


def _syncs(sites: list[dict]) -> list[tuple[int, int, list[tuple[dict, dict]]]]:
    """Every exchange of the run, in order: (fragment, send step, the results applied of it,
    each with its site's record). A drain or final step when leaving is left out."""
    held: dict[tuple[int, int], list] = {}
    for site in sites:
        for a in site["applies"]:
            if not a["final"]:
                held.setdefault((a["sent_at"], a["p"]), []).append((site, a))
    return [(p, t, held[(t, p)]) for t, p in sorted(held)]


def _contributions(sites: list[dict], p: int, t: int) -> list[tuple[int, dict, dict]]:
    """What each site sent of fragment ``p`` at step ``t`` with steps in it: (weight = its
    unsent inner steps, its send record, its site)."""
    return [(r["unsent"], r, site) for site in sites for r in site["sends"]
            if r["p"] == p and r["step"] == t and r["unsent"] > 0]  # fmt: skip


def _weighted(parts: list[tuple[float, torch.Tensor]]) -> torch.Tensor:
    return sum(w * d for w, d in parts) / sum(w for w, _ in parts)


def _split(flat: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [t.reshape(s) for t, s in zip(flat.split(sizes), shapes)]


def _check_method(method: str, sites: list[dict]) -> int:
    """Every exchange of the run recomputed in plain torch from what each site held when it
    sent (its reference point, local weights, unsent steps, error buffers), by the method's own
    math with each contribution weighted by its steps, then checked against every site's global
    copy, local weights (the merge) and error buffers after the result was applied. Returns how
    many exchanges had unequal weights."""
    from test_sparseloco import reference_compress

    kw = METHODS[method][1]
    momentum: dict[int, torch.Tensor] = {}  # Streaming's Nesterov buffer per fragment
    uneven = 0
    for p, t, applied in _syncs(sites):
        glob = applied[0][1]["glob"]
        after = applied[0][1]["glob_after"]
        for _, a in applied:  # every site that applied it holds the same before and after
            assert torch.equal(a["glob"], glob) and torch.equal(a["glob_after"], after), (p, t)
        parts = _contributions(sites, p, t)
        assert len(parts) == applied[0][1]["valid"], f"contributors of sync@{t} fragment {p}"
        weights = [float(w) for w, _, _ in parts]
        uneven += len(set(weights)) > 1
        if method == "sparseloco":
            # e_s <- beta e_s + (theta_hat - theta_s); each site sends C(e_s): per tile its top-k
            # entries, 2-bit quantised; the selected mean weights each sent entry by its site's
            # steps over the sites that sent that entry; outer SGD at lr 1
            beta, shapes = 0.95, sites[0]["shapes"][p]
            errs, sent, masks = {}, [], []
            for _, r, site in parts:
                e = beta * r["ef"] + (r["ref"] - r["local"])
                pieces = [reference_compress(x, kw["density"]) for x in _split(e, shapes)]
                errs[id(site)] = e
                sent.append(torch.cat([d.reshape(-1) for d, _ in pieces]))
                masks.append(torch.cat([m.reshape(-1) for _, m in pieces]))
            total = sum(w * d for w, d in zip(weights, sent))
            wsum = sum(w * m for w, m in zip(weights, masks))
            mean = torch.where(wsum > 0, total / wsum.clamp(min=1e-30), torch.zeros_like(total))
            expected = glob - 1.0 * mean
            # the error buffer keeps what the weighted merge did not apply: the unweighted
            # selected mean applies v / c of an entry c sites sent, the weighted one w v / W, so
            # e <- e - (w c / W) v, which is e - v when the weights are equal (lock-step)
            count = sum(masks)
            for (w, _, site), d, m in zip(parts, sent, masks):
                share = torch.where(m > 0, w * count / wsum.clamp(min=1e-30), torch.ones_like(m))
                keep = errs[id(site)] - share * d
                mine = [a for s, a in applied if s is site]
                if mine:
                    torch.testing.assert_close(mine[0]["ef_after"], keep, rtol=0, atol=1e-6)
            for _, a in applied:  # replace merge
                assert torch.equal(a["local_after"], a["glob_after"])
        elif method == "streaming":
            # per-fragment weighted mean of theta_hat - theta_s, Nesterov (mu 0.9, lr 0.4; torch
            # SGD's: the first buffer is the gradient), then theta <- alpha theta + (1-alpha) hat
            mean = _weighted([(w, r["ref"] - r["local"]) for w, r, _ in parts])
            buf = momentum[p] = mean.clone() if p not in momentum else 0.9 * momentum[p] + mean
            expected = glob - 0.4 * (mean + 0.9 * buf)
            for _, a in applied:
                mix = 0.5 * a["local"] + 0.5 * a["glob_after"]
                torch.testing.assert_close(a["local_after"], mix, rtol=0, atol=2e-6)
        else:  # co2
            # delta_s = s_s - theta_s (its progress since its last send); outer SGD at lr 1 on the
            # weighted mean; theta <- theta_hat_new - kappa delta_s (its own round now in flight)
            mean = _weighted([(w, r["ref"] - r["local"]) for w, r, _ in parts])
            expected = glob - 1.0 * mean
            for site, a in applied:
                own = [r for r in site["sends"] if r["step"] == a["step"]]
                if own and own[0]["unsent"] > 0:
                    keep = a["glob_after"] - 0.5 * (own[0]["ref"] - own[0]["local"])
                    torch.testing.assert_close(a["local_after"], keep, rtol=0, atol=2e-6)
        torch.testing.assert_close(after, expected, rtol=0, atol=2e-6, msg=f"sync@{t} frag {p}")
    return uneven


# SparseLoCo by default (its error buffers under weights); Streaming and CO2 by hand (-m slow,
# 8 s each): the same harness, their own references
@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=[] if m == "sparseloco" else [pytest.mark.slow]) for m in METHODS],
)
def test_a_slow_site_under_every_method_matches_its_weighted_reference(
    tmp_path, lighthouse, method
):
    preset, kw = METHODS[method]
    sites = _run(tmp_path, lighthouse, {"rounds": "quorum", "quorum": 2},
                 step_s=(0.0, 0.12, 0.0), preset=preset, kw=kw, steps=METHOD_STEPS)  # fmt: skip
    assert 0 < sites[1]["trained"] < METHOD_STEPS and sites[1]["cut"] >= 1
    assert len({s["shared"] for s in sites}) == 1
    assert _check_method(method, sites) >= 1, "no sync was weighted unevenly"


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_equal_sites_under_every_method_give_lockstep_bit_for_bit(tmp_path, lighthouse, method):
    preset, kw = METHODS[method]
    (tmp_path / "lock").mkdir()
    (tmp_path / "quorum").mkdir()
    server = _lighthouse(30.0)
    try:
        lock = _run(tmp_path / "lock", server.address(), {}, preset=preset, kw=kw,
                    steps=METHOD_STEPS)  # fmt: skip
    finally:
        server.shutdown()
    quorum = _run(tmp_path / "quorum", lighthouse, {"rounds": "quorum", "quorum": 2, "grace": 30},
                  preset=preset, kw=kw, steps=METHOD_STEPS)  # fmt: skip
    assert all(s["trained"] == METHOD_STEPS and s["cut"] == 0 for s in quorum)
    for a, b in zip(lock, quorum):
        assert torch.equal(a["global"], b["global"])
        # with overlap a result is still in flight in the kept state: its control flags'
        # unsent column holds the weights a quorum sync used (lock-step: 0 once sent)
        assert a["shared_but_flags"] == b["shared_but_flags"]
    # and every sync of it is the method's own math (unweighted: equal weights)
    assert _check_method(method, quorum) == 0
