"""The robust combine rules against independent NumPy computations of their definitions, and
what they are for: a minority of bad contributions (x1000, NaN flagged valid) moves none of
them far, where the plain mean follows the bad site."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowcomm.aggregate import COMBINES, Parts, aggregator_for, combine_for
from lowcomm.codecs import make_codec
from lowcomm.config import SyncConfig
from lowcomm.config.choices import DENSE_ONLY_RULES, SUM_RULES
from lowcomm.errors import ConfigError

ROBUST = ("median", "trimmed-mean", "norm-clip", "centered-clip")


def _parts(rows: np.ndarray, codec: str = "fp32", weights=None) -> Parts:
    c = make_codec(codec)
    payloads = [c.encode(torch.from_numpy(r.astype(np.float32))) for r in rows]
    shape = torch.Size([rows.shape[1]])
    return Parts(c, payloads, shape, [f"t{j}" for j in range(len(rows))], weights)


def _combine(rule: str, parts: Parts) -> np.ndarray:
    return combine_for(rule).combine(parts, torch.empty(parts.shape.numel())).numpy()


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


REFERENCE = {"median": _np_median, "trimmed-mean": _np_trimmed, "norm-clip": _np_norm_clip,
             "centered-clip": _np_centered_clip}  # fmt: skip


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


def test_norm_clip_on_top_k_clips_each_sites_values_then_takes_the_selected_mean():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 4096)).astype(np.float32)
    x[4] *= 1000.0
    parts = _parts(x, "topk")
    got = combine_for("norm-clip").combine(parts, torch.empty(4096)).numpy()
    sent = [parts.sparse(j) for j in range(6)]
    norms = np.array([np.linalg.norm(v.numpy()) for _, v in sent])
    bound = np.median(norms)
    total, count = np.zeros(4096), np.zeros(4096)
    for (idx, vals), norm in zip(sent, norms):
        np.add.at(total, idx.numpy(), vals.numpy() * min(1.0, bound / norm))
        np.add.at(count, idx.numpy(), 1)
    want = np.divide(total, count, out=np.zeros(4096), where=count > 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert count.max() >= 2  # entries that several sites sent: the selected mean is exercised


@pytest.mark.parametrize("rule", DENSE_ONLY_RULES)
def test_a_rule_that_defends_nothing_on_top_k_is_refused_with_one_line(rule):
    with pytest.raises(ConfigError, match="use aggregation=norm-clip") as info:
        SyncConfig(codec="topk", aggregation=rule)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="use aggregation=norm-clip"):
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
    payloads = [agg.encode([x]).payload for x in xs]
    red = agg._sum_gathered(payloads, [torch.Size([64])], 64)
    assert red.valid_workers == 3 and float(red.mean.max()) < 300.0


def test_a_self_reported_step_count_is_clamped_to_zero_and_twice_the_sync_period():
    """Quorum rounds weight a contribution by the inner steps its site says it holds: a site
    saying 10**6 steps (or -5) got that weight. Counts are clamped to [0, 2 H]."""
    from types import SimpleNamespace

    from lowcomm.engine.exchange import Exchange, flags_row

    exchange = Exchange.__new__(Exchange)
    exchange.runner = SimpleNamespace(membership=SimpleNamespace(
        elastic=SimpleNamespace(weighting="steps")))  # fmt: skip
    exchange.most_steps = 2 * 10
    rows = [flags_row(40, False, False, [h]) for h in (10, 10**6, -5, 7)]
    assert exchange.weights(torch.stack(rows), 0) == [10.0, 20.0, 0.0, 7.0]
    exchange.most_steps = 0  # no bound given: the counts as said (a negative one is none)
    assert exchange.weights(torch.stack(rows), 0) == [10.0, 1e6, 0.0, 7.0]
