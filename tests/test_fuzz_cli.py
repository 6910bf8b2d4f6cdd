"""Fuzzed command lines and configs: user errors give exit status 2, never a traceback."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowcomm import cli
from lowcomm.config import ConfigError, build_configs, config_fields

KEYS = sorted(config_fields()) + ["sync_evry", "H", "", "density "]
VALUES = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "1/64",
            "1/0",
            "abc",
            "true",
            "nan",
            "inf",
            "1e309",
            "strided",
            "topk",
            "fp4",
            "gather",
            "co2",
            "",
            "3.5",
            "99999999",
        ]
    ),
    st.text(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
def test_build_configs_only_raises_config_error(values):
    try:
        build_configs(values)
    except ConfigError:
        pass


@pytest.fixture
def no_launch(monkeypatch):
    import lowcomm.lab.bench.compare as compare
    import lowcomm.train.launch as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: None)
    monkeypatch.setattr(compare, "launch", lambda *a, **k: None)


ARGS = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "train",
                "compare",
                "simulate",
                "bench",
                "--strategy",
                "diloco",
                "ddp",
                "nope",
                "--workers",
                "0",
                "2",
                "-3",
                "--steps",
                "x",
                "--model",
                "tiny",
                "huge",
                "--strategies",
                "ddp,diloco:sync_every=5",
                "sparseloco:density",
                "--seeds",
                "0,a",
                "--port",
                "99999",
                "--resume",
                "/nonexistent",
                "--config",
                "/nonexistent.toml",
                "--json",
                "--help-not",
            ]
        ),
        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS[:12] + ["bogus"]), VALUES),
    ),
    max_size=8,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ARGS)
def test_cli_never_tracebacks_on_user_error(no_launch, tmp_path, argv):
    if argv[:1] in (["train"], ["compare"]):
        argv = argv + ["--out", str(tmp_path / "o")]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own --help/usage exits are fine
        code = e.code
    assert code in (0, 2)
