"""Error feedback and LoCo's moving-average compensation against few-line reference loops."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowcomm.codecs import make_codec
from lowcomm.compensation import ErrorFeedback, MovingAverageCompensation

PROP = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
SHAPES = {"w": (17, 33), "b": (33,), "s": ()}


def grads(steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(steps)]


def roundtrip_dict(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- error feedback ----------------------------------------------------------------------------


@PROP
@given(
    beta=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    codec=st.sampled_from(["topk", "int4", "fp4"]),
    seed=st.integers(0, 10_000),
    steps=st.integers(1, 5),
)
def test_error_feedback_matches_reference(beta, codec, seed, steps):
    c = make_codec(codec, density=0.1)
    ef = ErrorFeedback(beta)
    ref = {k: torch.zeros(s) for k, s in SHAPES.items()}
    for step in grads(steps, seed):
        for k, x in step.items():
            # reference: e <- beta e + x; send C(e); e <- e - D(C(e))
            ref[k] = beta * ref[k] + x
            sent_ref = c.roundtrip(ref[k])
            ref_after = ref[k] - sent_ref

            e = ef.accumulate(k, x)
            assert torch.allclose(e, ref[k], atol=1e-6)
            sent = c.roundtrip(e)
            ef.subtract(k, sent)
            ref[k] = ref_after
            assert torch.allclose(ef.buffer(k), ref[k], atol=1e-6)


def test_error_feedback_residual_keeps_what_was_not_sent():
    c = make_codec("topk", density=1 / 64, value_codec="fp32")
    ef = ErrorFeedback(0.95)
    x = torch.randn(64, 64)
    e = ef.accumulate("w", x)
    sent = c.roundtrip(e)
    ef.subtract("w", sent)
    left = ef.buffer("w")
    assert torch.equal(left + sent, x)  # exactly: top-k values sent in fp32
    assert int((left == 0).sum()) == 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bf16", torch.int8])
def test_error_feedback_low_precision_storage(dtype):
    ef = ErrorFeedback(0.9, dtype=dtype)
    x = torch.randn(100, 7)
    e = ef.accumulate("w", x)
    assert e.dtype == torch.float32 and torch.equal(e, x)
    stored = ef._store.buffers["w"]
    assert stored.dtype == (torch.int8 if dtype == torch.int8 else torch.bfloat16)
    sent = make_codec("int4").roundtrip(e)
    ef.subtract("w", sent)
    want = x - sent  # the residual is computed from the FP32 e, then rounded once
    if dtype == torch.int8:
        assert (ef.buffer("w") - want).abs().max() <= want.abs().max() / 254 * 1.0001
    else:
        assert torch.equal(ef.buffer("w"), want.to(torch.bfloat16).float())


def test_error_feedback_state_dict_roundtrip():
    c = make_codec("int2")
    a, b = ErrorFeedback(0.9), ErrorFeedback(0.9)
    for step in grads(2, 1):
        for k, x in step.items():
            a.subtract(k, c.roundtrip(a.accumulate(k, x)))
    state = roundtrip_dict(a.state_dict())
    assert set(state["buffers"]) == set(SHAPES)
    b.load_state_dict(state)
    for step in grads(2, 2):
        for k, x in step.items():
            ea, eb = a.accumulate(k, x), b.accumulate(k, x)
            assert torch.equal(ea, eb)
            a.subtract(k, c.roundtrip(ea))
            b.subtract(k, c.roundtrip(eb))
    with pytest.raises(ValueError):
        MovingAverageCompensation(0.8).load_state_dict(state)


def test_error_feedback_int8_state_roundtrip():
    a = ErrorFeedback(0.5, dtype="int8")
    a.accumulate("w", torch.randn(5, 5))
    b = ErrorFeedback(0.5, dtype=torch.int8)
    b.load_state_dict(roundtrip_dict(a.state_dict()))
    assert torch.equal(a.buffer("w"), b.buffer("w"))
    with pytest.raises(ValueError):
        ErrorFeedback(0.5).load_state_dict(roundtrip_dict(a.state_dict()))


def test_error_feedback_errors_and_reset():
    ef = ErrorFeedback(0.9)
    with pytest.raises(KeyError):
        ef.subtract("nope", torch.zeros(3))
    ef.accumulate("w", torch.ones(3))
    with pytest.raises(ValueError):
        ef.accumulate("w", torch.ones(4))
    ef.reset()
    assert torch.equal(ef.buffer("w"), torch.zeros(3))
    with pytest.raises(ValueError):
        ErrorFeedback(1.5)
    with pytest.raises(ValueError):
        ErrorFeedback(0.9, dtype=torch.float16)


# ---- LoCo --------------------------------------------------------------------------------------


@PROP
@given(
    beta=st.sampled_from([0.0, 0.8, 0.99]),
    codec=st.sampled_from(["int4", "int2", "fp4"]),
    seed=st.integers(0, 10_000),
    steps=st.integers(1, 6),
    reset_every=st.sampled_from([0, 1, 3]),
)
def test_loco_matches_reference(beta, codec, seed, steps, reset_every):
    c = make_codec(codec)
    comp = MovingAverageCompensation(beta, reset_every=reset_every)
    ref = {k: torch.zeros(s) for k, s in SHAPES.items()}
    for t, step in enumerate(grads(steps, seed), start=1):
        for k, g in step.items():
            h_ref = g + ref[k]
            d_ref = c.roundtrip(h_ref)
            ref[k] = beta * ref[k] + (1 - beta) * (h_ref - d_ref)

            h = comp.compensate(k, g)
            assert torch.allclose(h, h_ref, atol=1e-6)
            comp.update(k, h, c.roundtrip(h))
            assert torch.allclose(comp.buffer(k), ref[k], atol=1e-5)
        comp.step()
        if reset_every and t % reset_every == 0:
            ref = {k: torch.zeros(s) for k, s in SHAPES.items()}
            for k in SHAPES:
                assert torch.equal(comp.buffer(k), ref[k])
    assert comp.steps == steps


def test_loco_compensate_does_not_touch_the_buffer():
    comp = MovingAverageCompensation(0.8)
    g = torch.ones(4)
    h = comp.compensate("w", g)
    comp.update("w", h, torch.zeros(4))  # e = 0.2 * 1
    before = comp.buffer("w").clone()
    h = comp.compensate("w", g)
    h.add_(100.0)
    assert torch.equal(comp.buffer("w"), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_loco_state_dict_and_storage(dtype):
    c = make_codec("loco")
    a = MovingAverageCompensation(0.8, dtype=dtype, reset_every=5)
    for step in grads(3, 4):
        for k, g in step.items():
            h = a.compensate(k, g)
            a.update(k, h, c.roundtrip(h))
        a.step()
    assert all(v.dtype == dtype for v in a._store.buffers.values())
    state = roundtrip_dict(a.state_dict())
    b = MovingAverageCompensation(0.0, dtype=dtype)
    b.load_state_dict(state)
    assert (b.beta, b.reset_every, b.steps) == (0.8, 5, 3)
    for k in SHAPES:
        assert torch.equal(a.buffer(k), b.buffer(k))
    b.step(), b.step()  # step 5 resets
    assert all(torch.count_nonzero(b.buffer(k)) == 0 for k in SHAPES)


def test_loco_int8_storage_error_is_bounded():
    comp = MovingAverageCompensation(0.0, dtype="int8")
    g = torch.randn(1000)
    h = comp.compensate("w", g)
    dec = make_codec("int4").roundtrip(h)
    comp.update("w", h, dec)
    want = h - dec
    assert (comp.buffer("w") - want).abs().max() <= want.abs().max() / 254 * 1.0001


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_state_on_cpu_inputs_on_cuda():
    ef = ErrorFeedback(0.9, device="cpu")
    x = torch.randn(10, device="cuda")
    e = ef.accumulate("w", x)
    assert e.device.type == "cuda" and ef._store.buffers["w"].device.type == "cpu"
    ef.subtract("w", make_codec("int4").roundtrip(e))
    comp = MovingAverageCompensation(0.8, device="cpu")
    h = comp.compensate("w", x)
    comp.update("w", h, make_codec("int4").roundtrip(h))
    assert h.device.type == "cuda" and comp._store.buffers["w"].device.type == "cpu"


# ---- the interface the engine, the aggregator and the hooks share ---------------------------


def test_both_rules_follow_the_protocol_and_loco_resets_every_1024_steps_by_default():
    from lowcomm.compensation import DEFAULT_RESET_EVERY, Compensation

    for comp in (ErrorFeedback(0.9), MovingAverageCompensation(0.8)):
        for name in Compensation.__dict__:
            if not name.startswith("_"):
                assert callable(getattr(comp, name)), (type(comp).__name__, name)
    assert DEFAULT_RESET_EVERY == 1024 and MovingAverageCompensation(0.8).reset_every == 1024
    loco = MovingAverageCompensation(0.5, reset_every=3)
    g = torch.ones(4)
    for k in range(1, 7):
        h = loco.before_send("w", g)
        loco.after_send("w", h, torch.zeros(4))
        loco.step()
        # e = 0.5 e + 0.5 h, h = 1 + e, from e = 0 after each reset: 0.5, 1.0, then zero
        want = 0.0 if k % 3 == 0 else [0.5, 1.0][k % 3 - 1]
        assert torch.equal(loco.buffer("w"), torch.full((4,), want)), k


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_rescale_multiplies_every_buffer(dtype):
    for comp in (ErrorFeedback(1.0, dtype=dtype), MovingAverageCompensation(0.0, dtype=dtype)):
        x = torch.tensor([1.0, -2.0, 0.5, 4.0])
        h = comp.before_send("w", x)
        comp.after_send("w", h, torch.zeros(4))
        before = comp.buffer("w")
        comp.rescale(0.25)
        assert torch.equal(comp.buffer("w"), before * 0.25), type(comp).__name__


def test_device_none_keeps_buffers_with_the_tensors():
    comp = MovingAverageCompensation(0.8, device=None)
    x = torch.randn(5, dtype=torch.float64)  # a CPU tensor: the buffer lands on the CPU too
    h = comp.before_send("w", x)
    comp.after_send("w", h, torch.zeros(5))
    assert comp.device is None and comp._store.buffers["w"].device == x.device
    again = MovingAverageCompensation(0.8, device=None)
    again.load_state_dict(roundtrip_dict(comp.state_dict()))
    assert torch.equal(again.buffer("w"), comp.buffer("w"))
