"""The combine rules apart from the exchanges: the registry the config's choices follow, the
sum-only exchanges' refusal, and a rule seeing each contribution with its weight."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lowcomm.aggregate import COMBINES, GatherAggregator, aggregator_for, combine_for
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


def test_gather_hands_the_rule_each_valid_contribution_with_its_weight():
    """Three fake sites' payloads, the middle one left out: the rule's mean is over the others."""
    codec = make_codec("fp32")
    agg = GatherAggregator(codec, 3)
    xs = [torch.full((5,), float(v)) for v in (1.0, 100.0, 4.0)]
    payloads = [agg.encode([x], valid=j != 1).payload for j, x in enumerate(xs)]
    red = agg._sum_gathered(payloads, [torch.Size([5])], 5, weights=[1.0, 7.0, 2.0])
    assert red.valid_workers == 2
    assert torch.equal(red.mean, torch.full((5,), (1.0 + 2 * 4.0) / 3))


def test_a_payload_that_fails_to_decode_is_named_by_its_sender():
    """Every receiver decodes the parts in the same order: the first that fails on its own is
    the one named, so all receivers blame the same sender (here group rank 5 of 0, 5, 2)."""
    from lowcomm.aggregate.combine import Parts
    from lowcomm.errors import PayloadError

    codec = make_codec("int8")
    payloads = [codec.encode(torch.full((64,), float(v))) for v in (1, 2, 3)]
    payloads[1] = payloads[1].clone()
    payloads[1][0] ^= 0xFF  # a flipped header byte
    parts = Parts(codec, payloads, torch.Size([64]), ["t"] * 3, None, senders=[0, 5, 2])
    with pytest.raises(PayloadError) as info:
        try:
            combine_for("mean").combine(parts, torch.empty(64))
        except PayloadError as err:
            raise parts.blame(err) from None
    assert info.value.sender == 5


def test_gather_names_the_sender_of_a_payload_that_fails_to_decode():
    """The exchange's own path: a flipped header byte in worker 1's payload (its flag valid)
    is named by its group rank, so every receiver accuses the same sender."""
    from lowcomm.errors import PayloadError

    agg = GatherAggregator(make_codec("int8"), 3)
    payloads = [agg.encode([torch.full((64,), float(v))]).payload.clone() for v in (1, 2, 3)]
    payloads[1][0] ^= 0xFF
    with pytest.raises(PayloadError) as info:
        agg._sum_gathered(payloads, [torch.Size([64])], 64)
    assert info.value.sender == 1


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
