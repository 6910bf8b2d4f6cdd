"""The robust combine rules against independent NumPy computations of their definitions, and
what they are for: a minority of bad contributions (x1000, NaN flagged valid) moves none of
them far, where the plain mean follows the bad site."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowcomm.aggregate import COMBINES, Contributions, aggregator_for, combine_for, encode_tensors
from lowcomm.codecs import make_codec
from lowcomm.config import SyncConfig
from lowcomm.config.choices import DENSE_ONLY_RULES, SUM_RULES
from lowcomm.errors import ConfigError

ROBUST = ("median", "trimmed-mean", "norm-clip", "centered-clip", "cosine-clip")


def _parts(rows: np.ndarray, codec: str = "fp32", weights=None, shapes=None) -> Contributions:
    """Each row encoded and decoded by the codec's plan of ``shapes`` (one tensor of the row's
    length by default), as the gather exchange hands them to a rule: a part that does not
    decode is not present."""
    c = make_codec(codec)
    plan = c.plan(shapes or [torch.Size([rows.shape[1]])], torch.device("cpu"))
    decoded, present = [], []
    for r in rows:
        out = torch.empty(plan.span + 1, dtype=torch.uint8)
        plan.encode(torch.from_numpy(r.astype(np.float32)), out)
        idx, values, bad = plan.decode(out)
        decoded.append((idx, values))
        present.append(not bool(bad))
    return Contributions(plan, decoded, weights, torch.tensor(present))


def _combine(rule: str, parts: Contributions) -> np.ndarray:
    return combine_for(rule).combine(parts, torch.empty(parts.numel)).numpy()


def _gather(agg, xs: list[torch.Tensor]):
    """What the gather exchange combines of ``xs`` (one payload per worker), as worker 0."""
    encs = [encode_tensors(agg, [x]) for x in xs]
    e = encs[0]
    return agg.combine(
        e.plan, e.flag_at, [x.payload for x in encs], None, torch.empty(e.numel), None, 0
    )


def _np_median(x):
    return np.median(x, axis=0)


def _np_trimmed(x):
    n = len(x)
    b = 0 if n < 3 else min(max(1, int(0.25 * n)), (n - 1) // 2)
    return np.sort(x, axis=0)[b : n - b].mean(axis=0)


def _np_clip(x, bound):
    norms = np.linalg.norm(x, axis=1)
    return x * np.minimum(1.0, bound / np.maximum(norms, 1e-30))[:, None]


def _np_norm_clip(x):
    return _np_clip(x, np.median(np.linalg.norm(x, axis=1))).mean(axis=0)


def _np_centered_clip(x):
    v = np.median(x, axis=0)
    for _ in range(3):
        tau = np.median(np.linalg.norm(x - v, axis=1))
        if tau <= 0:
            break
        v = v + _np_clip(x - v, tau).mean(axis=0)
    return v


def _np_cosine_clip(x):
    x = _np_clip(x, np.median(np.linalg.norm(x, axis=1)))
    keep = [r.any() and (len(x) == 1 or r @ (x.sum(axis=0) - r) >= 0) for r in x]
    return x[keep].mean(axis=0) if any(keep) else np.zeros(x.shape[1])


REFERENCE = {"median": _np_median, "trimmed-mean": _np_trimmed, "norm-clip": _np_norm_clip,
             "centered-clip": _np_centered_clip, "cosine-clip": _np_cosine_clip}  # fmt: skip


@pytest.mark.parametrize("rule", ROBUST)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_each_robust_rule_is_its_definition(rule, n):
    x = np.random.default_rng(n).normal(size=(n, 257)) * np.arange(1, n + 1)[:, None]
    np.testing.assert_allclose(_combine(rule, _parts(x)), REFERENCE[rule](x), rtol=2e-5,
                               atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("rule", ROBUST)
def test_one_site_of_eight_sending_1000x_moves_no_robust_rule_far(rule):
    """The threat: one finite x1000 contribution moves the plain mean (and so every replica)
    by hundreds of honest updates; a robust rule stays near the honest sites' mean."""
    rng = np.random.default_rng(0)
    honest = rng.normal(size=256) + rng.normal(scale=0.3, size=(8, 256))
    sent = honest.copy()
    sent[3] *= 1000.0
    truth = honest.mean(axis=0)
    mean_off = np.linalg.norm(_combine("mean", _parts(sent)) - truth)
    rule_off = np.linalg.norm(_combine(rule, _parts(sent)) - truth)
    assert mean_off > 50 * np.linalg.norm(truth)  # the plain mean is the bad site's
    assert rule_off < 0.25 * np.linalg.norm(truth), (rule, rule_off)


@pytest.mark.parametrize("rule", ROBUST)
def test_a_nan_contribution_flagged_valid_is_dropped(rule):
    """A site's validity flag is its own word: a robust rule drops what is not finite."""
    x = np.random.default_rng(1).normal(size=(5, 64))
    bad = x.copy()
    bad[2, 7] = np.nan
    got = _combine(rule, _parts(bad))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, REFERENCE[rule](np.delete(x, 2, axis=0)), rtol=2e-5,
                               atol=1e-6)  # fmt: skip
    assert (_combine(rule, _parts(np.full((2, 8), np.inf))) == 0).all()  # nothing finite


@pytest.mark.parametrize("rule", ROBUST)
def test_a_robust_rule_takes_no_self_reported_weight(rule):
    """A weight is what a site says of itself (its steps): a robust rule counts each once, and
    so leaves nothing of a part unapplied."""
    x = np.random.default_rng(2).normal(size=(4, 32))
    weighted = _parts(x, weights=[1.0, 40.0, 1.0, 1.0])
    np.testing.assert_array_equal(_combine(rule, weighted), _combine(rule, _parts(x)))
    assert not combine_for(rule).unapplied(weighted, 1).any()


@pytest.mark.parametrize("rule", ROBUST)
def test_a_robust_rule_decides_tensor_by_tensor_over_a_whole_fragment(rule):
    """Over a fragment of several tensors, each tensor's combination is the rule's definition
    on that tensor's parts alone (a NaN in one part's tensor leaves that part out of it only)."""
    shapes = [torch.Size([5, 7]), torch.Size([64]), torch.Size([3])]
    sizes = [s.numel() for s in shapes]
    x = np.random.default_rng(9).normal(size=(5, sum(sizes))) * np.arange(1, 6)[:, None]
    x[2, 40] = np.nan  # in the second tensor
    got = _combine(rule, _parts(x, shapes=shapes))
    at = 0
    for n in sizes:
        rows = x[:, at : at + n]
        rows = rows[np.isfinite(rows).all(axis=1)]
        np.testing.assert_allclose(got[at : at + n], REFERENCE[rule](rows), rtol=2e-5, atol=1e-6)
        at += n


def test_norm_clip_on_top_k_clips_each_sites_values_then_takes_the_selected_mean():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 4096)).astype(np.float32)
    x[4] *= 1000.0
    parts = _parts(x, "topk")
    got = combine_for("norm-clip").combine(parts, torch.empty(4096)).numpy()
    sent = [(parts.index(j), parts.values(j)) for j in range(6)]
    norms = np.array([np.linalg.norm(v.numpy()) for _, v in sent])
    bound = np.median(norms)
    total, count = np.zeros(4096), np.zeros(4096)
    for (idx, vals), norm in zip(sent, norms):
        np.add.at(total, idx.numpy(), vals.numpy() * min(1.0, bound / norm))
        np.add.at(count, idx.numpy(), 1)
    want = np.divide(total, count, out=np.zeros(4096), where=count > 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert count.max() >= 2  # entries that several sites sent: the selected mean is exercised


def _np_selected_mean(sent, scale, keep):
    total, count = np.zeros(4096), np.zeros(4096)
    for (idx, vals), s, k in zip(sent, scale, keep):
        if k:
            np.add.at(total, idx.numpy(), vals.numpy() * s)
            np.add.at(count, idx.numpy(), 1)
    return np.divide(total, count, out=np.zeros(4096), where=count > 0)


def test_cosine_clip_on_top_k_drops_the_sites_against_the_rest_and_the_empty_ones():
    """Sign flips on top-k: each entry has few senders, so a flipped site's values are applied
    whole by the (clipped) selected mean; cosine-clip leaves out a site whose values point
    against the sum of the others', and a free-rider's all-zero values, which would dilute."""
    rng = np.random.default_rng(4)
    honest = rng.normal(size=4096) + rng.normal(scale=0.7, size=(8, 4096))
    x = honest.astype(np.float32)
    x[6] *= -1.0
    x[7] = 0.0
    parts = _parts(x, "topk")
    got = combine_for("cosine-clip").combine(parts, torch.empty(4096)).numpy()
    sent = [(parts.index(j), parts.values(j)) for j in range(8)]
    assert not sent[7][1].any()  # the free-rider's: left out before anything else
    sent = sent[:7]
    norms = np.array([np.linalg.norm(v.numpy()) for _, v in sent])
    scale = np.minimum(1.0, np.median(norms) / norms)
    total = np.zeros(4096)  # the sum of the clipped values
    for (idx, vals), s in zip(sent, scale):
        np.add.at(total, idx.numpy(), vals.numpy() * s)
    keep = [float(v.numpy() * s @ (total[i.numpy()] - v.numpy() * s)) >= 0
            for (i, v), s in zip(sent, scale)]  # fmt: skip
    assert keep == [True] * 6 + [False]
    np.testing.assert_allclose(got, _np_selected_mean(sent, scale, keep), rtol=2e-5, atol=1e-6)
    # what the attack costs: the honest sites' selected mean against each rule's
    truth = _np_selected_mean(sent[:6], scale[:6], [True] * 6)
    clipped = combine_for("norm-clip").combine(parts, torch.empty(4096)).numpy()
    assert np.linalg.norm(got - truth) < 0.2 * np.linalg.norm(clipped - truth)


def test_share_clip_counts_an_entry_few_sent_as_their_share_of_a_majority():
    """On top-k most entries have one sender; the selected mean applies those whole, so a site
    spending its budget where nobody else sends moves them as far as everyone together.
    share-clip divides each entry's sum by max(senders, a majority of the parts), and hands
    back to a sender what of its part that held back."""
    rng = np.random.default_rng(6)
    x = (rng.normal(size=4096) + rng.normal(scale=0.7, size=(8, 4096))).astype(np.float32)
    parts = _parts(x, "topk")
    rule = combine_for("share-clip")
    got = rule.combine(parts, torch.empty(4096)).numpy()
    sent = [(parts.index(j), parts.values(j)) for j in range(8)]
    norms = np.array([np.linalg.norm(v.numpy()) for _, v in sent])
    scale = np.minimum(1.0, np.median(norms) / norms)
    total, count = np.zeros(4096), np.zeros(4096)
    for (idx, vals), s in zip(sent, scale):
        np.add.at(total, idx.numpy(), vals.numpy() * s)
        np.add.at(count, idx.numpy(), 1)
    assert (count == 1).sum() > (count >= 5).sum() > 0  # lone entries and majority ones both
    want = total / np.maximum(count, 8 // 2 + 1)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # where a majority sent an entry it is their selected mean, as cosine-clip's
    sel = combine_for("cosine-clip").combine(parts, torch.empty(4096)).numpy()
    np.testing.assert_allclose(got[count >= 5], sel[count >= 5], rtol=2e-5, atol=1e-6)
    # handed back to site 3, in the error buffer's units (the selected mean applies a part
    # whole): the share held back, 1 - c / max(c, 5), of its values as sent; none where a
    # majority sent the entry
    idx, back = rule.unapplied(parts, 3)
    i3, v3 = (t.numpy() for t in sent[3])
    np.testing.assert_array_equal(idx.numpy(), i3)
    held = 1.0 - count[i3] / np.maximum(count[i3], 5)
    np.testing.assert_allclose(back.numpy(), v3 * held, rtol=2e-5, atol=1e-6)
    assert (back.numpy()[count[i3] >= 5] == 0).all() and (held > 0).any()


def test_share_clip_bounds_a_site_that_sends_where_nobody_else_does():
    """Two of eight sites put their whole (median-norm) budget on entries no honest site
    picks, the same every sync: the selected mean of cosine-clip applies them whole, share-clip
    a fifth (a lone sender's share of a majority of 8)."""
    rng = np.random.default_rng(7)
    x = (rng.normal(size=4096) + rng.normal(scale=0.7, size=(8, 4096))).astype(np.float32)
    honest = _parts(x[:6], "topk")
    picked = set(np.concatenate([honest.index(j).numpy() for j in range(6)]).tolist())
    free = np.array([i for i in range(4096) if i not in picked])
    for j in (6, 7):  # the same sign, on its own entries nobody else picks
        x[j] = 0.0
        x[j, free[(j - 6) * 64 : (j - 5) * 64]] = 5.0
    parts = _parts(x, "topk")
    bad = free[:128]
    moved = {r: np.abs(_combine(r, parts)[bad]).max() for r in ("cosine-clip", "share-clip")}
    assert moved["share-clip"] < 0.25 * moved["cosine-clip"]


@pytest.mark.parametrize("rule", ["norm-clip", "cosine-clip"])
def test_a_top_k_part_that_does_not_decode_is_dropped_by_a_robust_rule_and_stops_the_plain_one(
    rule,
):
    """A NaN sent as top-k does not decode (its scale is NaN): the selected mean stops the run
    naming the sender; a robust rule leaves that part out, the same on every receiver."""
    from lowcomm.errors import PayloadError

    x = np.random.default_rng(5).normal(size=(4, 4096)).astype(np.float32)
    bad = x.copy()
    bad[1] = np.nan
    parts, without = _parts(bad, "topk"), _parts(np.delete(x, 1, axis=0), "topk")
    got = combine_for(rule).combine(parts, torch.empty(4096)).numpy()
    np.testing.assert_array_equal(got, _combine(rule, without))
    plain = aggregator_for("gather", make_codec("topk"), 4, aggregation="selected-mean")
    xs = [torch.from_numpy(r) for r in bad]
    with pytest.raises(PayloadError, match="non-finite") as stopped:
        _gather(plain, xs)
    assert stopped.value.sender == 1
    # a free-rider's all-zero part says nothing: left out too, where the selected mean counts it
    empty = np.vstack([x, np.zeros((1, 4096), np.float32)])
    np.testing.assert_array_equal(
        _combine(rule, _parts(empty, "topk")), _combine(rule, _parts(x, "topk"))
    )
    assert not np.array_equal(_combine("selected-mean", _parts(empty, "topk")),
                              _combine("selected-mean", _parts(x, "topk")))  # fmt: skip


@pytest.mark.parametrize("rule", DENSE_ONLY_RULES)
def test_a_rule_that_defends_nothing_on_top_k_is_refused_with_one_line(rule):
    with pytest.raises(ConfigError, match=r"use aggregation=cosine-clip \(or norm-clip\)") as info:
        SyncConfig(codec="topk", aggregation=rule)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"use aggregation=cosine-clip \(or norm-clip\)"):
        aggregator_for("gather", make_codec("topk"), 2, aggregation=rule)
    assert COMBINES[rule].dense_only
    assert sorted(n for n, c in COMBINES.items() if c.dense_only) == sorted(DENSE_ONLY_RULES)
    assert sorted(n for n, c in COMBINES.items() if c.sum_decomposable) == sorted(SUM_RULES)


@pytest.mark.parametrize("rule", ROBUST)
def test_a_robust_rule_runs_on_gather_only(rule):
    with pytest.raises(ConfigError, match="use reduce=gather") as info:
        SyncConfig(codec="fp32", reduce="allreduce", aggregation=rule)
    assert "\n" not in str(info.value)
    assert SyncConfig(codec="fp32", aggregation=rule).resolved_reduce == "gather"
    agg = aggregator_for("gather", make_codec("int8"), 3, aggregation=rule)
    xs = [torch.full((64,), float(v)) for v in (1.0, 2.0, 500.0)]
    red = _gather(agg, xs)
    assert red.valid_workers == 3 and float(red.mean.max()) < 300.0


def test_a_self_reported_step_count_is_clamped_to_zero_and_twice_the_sync_period():
    """Quorum rounds weight a contribution by the inner steps its site says it holds: a site
    saying 10**6 steps (or -5) got that weight. Counts are clamped to [0, 2 H]."""
    from types import SimpleNamespace

    from lowcomm.engine.sync import Exchange, flags_row

    exchange = Exchange.__new__(Exchange)
    exchange.runner = SimpleNamespace(membership=SimpleNamespace(
        elastic=SimpleNamespace(weighting="steps")))  # fmt: skip
    exchange.most_steps = 2 * 10
    rows = [flags_row(40, False, False, [h]) for h in (10, 10**6, -5, 7)]
    assert exchange.weights(torch.stack(rows), 0) == [10.0, 20.0, 0.0, 7.0]
    exchange.most_steps = 0  # no bound given: the counts as said (a negative one is none)
    assert exchange.weights(torch.stack(rows), 0) == [10.0, 1e6, 0.0, 7.0]


def test_a_sender_the_rule_leaves_out_reads_as_offending_and_is_named_in_three_syncs():
    """cosine-clip leaves a sign-flipped top-k contribution out with no norm out of line: the
    gather reports that sender's norm as not finite (left out of most of what it sent), which
    the offender count takes as offending, so the flipper is named as a x1000 sender is."""
    from types import SimpleNamespace

    from lowcomm.engine.check import Offenders

    agg = aggregator_for("gather", make_codec("topk"), 5, aggregation="cosine-clip")
    agg.track = True
    rng = np.random.default_rng(6)
    honest = rng.normal(size=4096) + rng.normal(scale=0.7, size=(5, 4096))
    xs = [torch.from_numpy(r.astype(np.float32)) for r in honest]
    xs[3] = -xs[3]
    red = _gather(agg, xs)
    assert red.norms is not None and np.isinf(red.norms[3])
    assert all(np.isfinite(red.norms[w]) for w in (0, 1, 2, 4))
    stats = SimpleNamespace(extra={})
    offenders = Offenders(3, evict=False, stats=stats)
    assert [offenders.observe(red, step) for step in (10, 20, 30)] == [[], [], [3]]
    assert stats.extra["offenders"] == {"3": 1}
