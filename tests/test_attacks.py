"""Attack faults: read from the one fault grammar, and acted out by the bad site on what it
sends (in place, before encoding)."""

from __future__ import annotations

import pytest
import torch

from lowcomm.elastic import faults as faults_mod
from lowcomm.elastic.faults import Fault, act, attack, parse_faults
from lowcomm.errors import ConfigError


@pytest.fixture(autouse=True)
def _unarmed():
    faults_mod._attacking.clear()
    yield
    faults_mod._attacking.clear()


def test_attacks_are_read_from_the_fault_grammar():
    got = parse_faults("signflip:1@20,scale:2x1000,noise:0x2,zero:3,nan:1@5", 4, 100)
    assert got == [Fault("signflip", 1, 20), Fault("scale", 2, 1, 1000.0),
                   Fault("noise", 0, 1, 2.0), Fault("zero", 3, 1), Fault("nan", 1, 5)]  # fmt: skip
    for bad, why in [("scale:1", "needs xFACTOR > 0"), ("noise:1x0", "needs xFACTOR > 0"),
                     ("signflip:1x2", "takes no xFACTOR"), ("alie:1", "not supported yet"),
                     ("copy:1", "not supported yet"), ("zero:9", "names site 9")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why) as info:
            parse_faults(bad, 4, 100)
        assert "\n" not in str(info.value)


def test_a_site_attacks_from_its_step_on_and_only_itself():
    planned = parse_faults("scale:1@3x10", 4, 100)
    x = [torch.ones(4)]
    act(planned, site=0, step=3)  # another site's fault: this one sends as it is
    act(planned, site=1, step=2)  # not yet
    attack(x, 2)
    assert torch.equal(x[0], torch.ones(4))
    act(planned, site=1, step=3)
    for step in (3, 4, 50):
        x = [torch.ones(4), torch.full((2,), -2.0)]
        attack(x, step)
        assert torch.equal(x[0], torch.full((4,), 10.0)) and torch.equal(
            x[1], torch.full((2,), -20.0)
        )


@pytest.mark.parametrize(("spec", "check"), [
    ("signflip:0", lambda x, y: torch.equal(y, -x)),
    ("zero:0", lambda x, y: not y.any()),
    ("nan:0", lambda x, y: bool(torch.isnan(y).all())),
    ("noise:0x2", lambda x, y: 1.8 < float((y - x).norm() / x.norm()) < 2.2),
])  # fmt: skip
def test_each_attack_does_what_it_says(spec, check):
    act(parse_faults(spec, 2, 10), site=0, step=1)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    attack([y], 7)
    assert check(x, y)


def test_noise_is_the_same_in_a_replay():
    act(parse_faults("noise:0x1", 2, 10), site=0, step=1)
    a, b = [torch.ones(64)], [torch.ones(64)]
    attack(a, 9)
    attack(b, 9)
    c = [torch.ones(64)]
    attack(c, 10)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_the_attack_matrix_reads_each_cell_against_the_clean_plain_run():
    from lowcomm.bench.attacks import table

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
