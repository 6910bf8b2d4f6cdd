"""The combine rules apart from the exchanges: the registry the config's choices follow, the
sum-only exchanges' refusal, and a rule seeing each contribution with its weight."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lowcomm.aggregate import COMBINES, GatherAggregator, aggregator_for, encode_tensors
from lowcomm.codecs import make_codec
from lowcomm.config.choices import AGGREGATIONS
from lowcomm.errors import ConfigError


def test_the_configs_choices_are_the_registered_rules():
    """The config stays free of torch, so it lists the rules by their files: it must name
    exactly the rules that register themselves (a fresh process: only the rules lowcomm ships)."""
    code = "import lowcomm.aggregate as a; print(' '.join(sorted(a.COMBINES)))"
    shipped = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    assert [c for c in AGGREGATIONS if c != "auto"] == shipped
    assert set(shipped) <= set(COMBINES)


@pytest.mark.parametrize("method", ["allreduce", "two-phase"])
def test_a_rule_that_is_not_a_sum_is_refused_by_the_exchanges_that_only_sum(method):
    codec = None if method == "allreduce" else make_codec("int8")
    with pytest.raises(ConfigError, match="use reduce=gather") as info:
        aggregator_for(method, codec, 2, aggregation="selected-mean")
    assert "\n" not in str(info.value) and "aggregation=selected-mean" in str(info.value)


def test_an_unknown_rule_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown aggregation 'nope': choose one of .*mean"):
        aggregator_for("gather", make_codec("int8"), 2, aggregation="nope")


def _gathered(agg, payloads, n, weights=None):
    """The gather exchange's combination of ``payloads`` (one per worker), as worker 0."""
    enc = encode_tensors(agg, [torch.zeros(n)])
    return agg.combine(enc.plan, enc.flag_at, payloads, weights, torch.empty(n), None, 0)


def test_gather_hands_the_rule_each_valid_contribution_with_its_weight():
    """Three fake sites' payloads, the middle one left out: the rule's mean is over the others."""
    agg = GatherAggregator(make_codec("fp32"), 3)
    xs = [torch.full((5,), float(v)) for v in (1.0, 100.0, 4.0)]
    payloads = [encode_tensors(agg, [x], valid=j != 1).payload for j, x in enumerate(xs)]
    red = _gathered(agg, payloads, 5, weights=[1.0, 7.0, 2.0])
    assert red.valid_workers == 2
    assert torch.equal(red.mean, torch.full((5,), (1.0 + 2 * 4.0) / 3))


def test_gather_names_the_sender_of_a_payload_that_fails_to_decode():
    """A flipped header byte in workers 1's and 2's payloads (their flags valid): the first in
    rank order is named, by its group rank, so every receiver accuses the same sender."""
    from lowcomm.errors import PayloadError

    agg = GatherAggregator(make_codec("int8"), 3)
    payloads = [encode_tensors(agg, [torch.full((64,), float(v))]).payload for v in (1, 2, 3)]
    payloads[1][0] ^= 0xFF
    payloads[2][0] ^= 0xFF
    with pytest.raises(PayloadError, match="bad magic") as info:
        _gathered(agg, payloads, 64)
    assert info.value.sender == 1 and "from worker 1" in str(info.value)


def test_an_accused_group_rank_is_the_site_at_that_rank():
    """Group ranks are positions among the quorum's members, not site numbers."""
    from lowcomm.elastic.decide import View
    from lowcomm.elastic.runner import _accused
    from lowcomm.errors import PayloadError

    view = View(3, [0, 2, 3], [])
    assert _accused(view, PayloadError("bad flag", 1)) == (2, "bad flag")
    assert _accused(view, PayloadError("bad flag", 3)) is None  # no such rank
    assert _accused(view, PayloadError("bad flag")) is None  # sender unknown
    assert _accused(view, RuntimeError("peer gone")) is None


@pytest.mark.parametrize("name", ["fp4", "int4", "int8", "fp32", "bf16"])
def test_the_sum_decoded_straight_into_its_total_is_the_sum_of_the_decodes(name):
    """The plain sum decodes dense payloads into its total (the first written over it where
    no value can be -0.0): the same bits as each payload decoded, then added to zeros in
    sender order. -0.0 entries included, which a write would keep and an add would not."""
    from lowcomm.aggregate.combine import Contributions, combine_for

    codec = make_codec(name)
    shapes = [torch.Size([300, 7]), torch.Size([129])]
    plan = codec.plan(shapes, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    payloads = []
    for _ in range(3):
        flat = torch.randn(plan.numel, generator=g)
        flat[::17] = -0.0
        out = torch.zeros(plan.span + 1, dtype=torch.uint8)
        plan.encode(flat, out)
        payloads.append(out)
    want = torch.zeros(plan.numel)
    for p in payloads:
        want += plan.decode(p)[1]
    want /= 3
    rule = combine_for("mean")
    lazy = Contributions(plan, None, None, payloads=payloads)
    got = rule.combine(lazy, torch.full((plan.numel,), float("nan")))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert lazy.writes_first() == (name not in ("fp32", "bf16"))
