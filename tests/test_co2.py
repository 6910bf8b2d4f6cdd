"""CO2 in the engine: one-round-stale outer momentum with penalty and clipping, vs plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import StepGate, adamw, batches, flat_params, local_steps, tiny_model

import lowcomm
from lowcomm.outer import OuterCO2, gap_aware_penalty

H, ROUNDS, LR, BETA, CLIP = 3, 4, 1.0, 0.5, 0.004


def _co2_worker(
    rank: int,
    world: int,
    penalty: bool,
    clip: float,
    merge: str = "reset",
    extra: int = 0,
    keep: float = 1.0,
) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.CO2(
        model,
        opt,
        sync_every=H,
        outer_lr=LR,
        outer_momentum=BETA,
        staleness_penalty=penalty,
        momentum_clip=clip,
        co2_merge=merge,
        co2_keep=keep,
    )
    with sync:
        for _ in range(H * ROUNDS + extra):
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    return {"global": sync.global_flat().clone(), "model": flat_params(model)}


def reference_co2(world: int, penalty: bool, clip: float) -> torch.Tensor:
    """The earlier restart rule (co2_merge=reset) in plain torch, Gap-Aware penalty written out."""
    init = tiny_model(seed=0)
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [adamw(m) for m in models]
    data = [batches(r, world) for r in range(world)]
    theta = torch.cat([p.detach().reshape(-1) for p in init.parameters()])
    m = torch.zeros_like(theta)
    mean_abs = torch.zeros_like(theta)
    last = torch.zeros_like(theta)
    n_updates = 0

    def local(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def outer(stale):
        nonlocal m, last, mean_abs, n_updates
        lam = torch.ones_like(theta)
        if penalty and n_updates > 0:
            lam = 1.0 / torch.maximum(last.abs() / (mean_abs + 1e-12), torch.ones_like(theta))
        m = BETA * m + lam * stale
        if clip > 0:
            m = m.clamp(-clip, clip)
        last = LR * m
        theta.sub_(last)
        n_updates += 1
        mean_abs = mean_abs * (n_updates - 1) / n_updates + last.abs() / n_updates

    def restart():
        for model in models:
            torch.nn.utils.vector_to_parameters(theta.clone(), model.parameters())

    stale = None
    for _ in range(ROUNDS):
        for model, o, d in zip(models, opts, data):
            local_steps(model, o, d, H)
        delta = torch.stack([theta - local(model) for model in models]).mean(0)
        if stale is not None:
            outer(stale)
        restart()
        stale = delta
    outer(stale)  # the end: drain the round in flight
    return theta


@pytest.mark.parametrize(
    "penalty,clip",
    [pytest.param(True, CLIP, marks=pytest.mark.slow), (False, 0.0)],  # by hand
)
def test_co2_reset_ablation_matches_plain_torch(workers, penalty, clip):
    res = workers(_co2_worker, 2, penalty, clip, "reset")
    torch.set_num_threads(1)
    expected = reference_co2(2, penalty, clip)
    for r in res:
        torch.testing.assert_close(r["global"], expected, atol=1e-6, rtol=0)


def reference_co2_continue(
    world: int, penalty: bool, clip: float, extra: int, own: float = 1.0
) -> torch.Tensor:
    """The continue rule written out in plain torch, step by step as the method describes it.

    Each worker keeps s, its weights at the start of its round. After a round: delta = s - theta;
    the outer step uses the one-round-stale average; then theta <- theta_global - own * delta and
    s <- theta (own = co2_keep: 1 keeps all, 1/M is eager updates). At the end: drain the stale
    average, then average the partial round's progress and take one more outer step (what
    leaving does).
    """
    init = tiny_model(seed=0)
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [adamw(m) for m in models]
    data = [batches(r, world) for r in range(world)]
    theta = torch.nn.utils.parameters_to_vector(init.parameters()).detach().clone()
    state = {
        "m": torch.zeros_like(theta),
        "C": torch.zeros_like(theta),
        "last": torch.zeros_like(theta),
        "n": 0,
    }

    def outer(avg: torch.Tensor) -> None:
        lam = torch.ones_like(theta)
        if penalty and state["n"] > 0:
            lam = 1.0 / torch.maximum(
                state["last"].abs() / (state["C"] + 1e-12), torch.ones_like(theta)
            )
        state["m"] = BETA * state["m"] + lam * avg
        if clip > 0:
            state["m"] = state["m"].clamp(-clip, clip)
        state["last"] = LR * state["m"]
        theta.sub_(state["last"])
        state["n"] += 1
        n = state["n"]
        state["C"] = state["C"] * (n - 1) / n + state["last"].abs() / n

    def weights(model):
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()

    starts = [theta.clone() for _ in range(world)]
    stale = None
    for _ in range(ROUNDS):
        for model, o, d in zip(models, opts, data):
            local_steps(model, o, d, H)
        deltas = [s - weights(model) for s, model in zip(starts, models)]
        if stale is not None:
            outer(stale)
        for i, (model, delta) in enumerate(zip(models, deltas)):
            starts[i] = theta - own * delta
            torch.nn.utils.vector_to_parameters(starts[i].clone(), model.parameters())
        stale = torch.stack(deltas).mean(0)
    for model, o, d in zip(models, opts, data):
        local_steps(model, o, d, extra)
    outer(stale)
    if extra:
        outer(torch.stack([s - weights(model) for s, model in zip(starts, models)]).mean(0))
    return theta


@pytest.mark.parametrize(
    "world,penalty,clip,extra,keep",
    [(2, False, 0.0, 0, 1.0), (2, True, CLIP, 2, 1.0), (3, False, 0.0, 2, 0.3)],
)
def test_co2_continue_matches_plain_torch(workers, world, penalty, clip, extra, keep):
    """The continue rule keeping all or part (co2_keep) of the own round in flight, also when
    the run ends mid-round (the partial round is not lost)."""
    res = workers(_co2_worker, world, penalty, clip, "continue", extra, keep)
    torch.set_num_threads(1)
    expected = reference_co2_continue(world, penalty, clip, extra, keep)
    for r in res:
        torch.testing.assert_close(r["global"], expected, atol=1e-6, rtol=0)
        assert torch.equal(r["model"], r["global"])  # leaving loads the consolidated model


def test_keeping_none_of_the_round_is_the_restart_rule(workers):
    """co2_keep = 0 under the continue merge gives the reset rule's global model."""
    res = workers(_co2_worker, 2, False, 0.0, "continue", 0, 0.0)
    torch.set_num_threads(1)
    expected = reference_co2(2, False, 0.0)
    for r in res:
        torch.testing.assert_close(r["global"], expected, atol=1e-6, rtol=0)


def test_co2_keep_outside_zero_one_is_refused():
    with pytest.raises(lowcomm.ConfigError, match="co2_keep must be in"):
        lowcomm.SyncConfig(co2_keep=1.5)


def test_clipping_changes_momentum_exactly_when_exceeded():
    g = torch.tensor([0.5, -2.0, 1.0, -0.2])
    opt = OuterCO2(lr=1.0, momentum=0.0, penalty=False, clip=1.0)
    theta = torch.zeros(4)
    opt.step("f", theta, g)
    assert torch.equal(opt.state["f"]["momentum"], torch.tensor([0.5, -1.0, 1.0, -0.2]))
    assert torch.equal(theta, -torch.tensor([0.5, -1.0, 1.0, -0.2]))
    big = OuterCO2(lr=1.0, momentum=0.0, penalty=False, clip=10.0)
    theta2 = torch.zeros(4)
    big.step("f", theta2, g)
    assert torch.equal(theta2, -g)  # under the threshold: untouched
    norm = OuterCO2(lr=1.0, momentum=0.0, penalty=False, clip=1.0, clip_mode="norm")
    theta3 = torch.zeros(4)
    norm.step("f", theta3, g)
    torch.testing.assert_close(norm.state["f"]["momentum"].norm(), torch.tensor(1.0))


def test_outer_state_holds_only_what_the_settings_read():
    """The preset (no momentum, penalty or clip) keeps no model-sized state; each setting adds
    exactly its buffers, and the update is theta - lr * g either way at momentum 0."""
    g, cases = (
        torch.tensor([0.5, -2.0, 1.0]),
        [
            (dict(momentum=0.0, penalty=False), set()),
            (dict(momentum=0.5, penalty=False), {"momentum"}),
            (dict(momentum=0.0, penalty=False, clip=10.0), {"momentum"}),
            (dict(momentum=0.0, penalty=True), {"mean_abs_update", "last_update"}),
        ],
    )
    for kwargs, buffers in cases:
        opt = OuterCO2(lr=0.5, **kwargs)
        theta = torch.zeros(3)
        opt.step("f", theta, g)
        assert set(opt.state["f"]) - {"steps"} == buffers, kwargs
        assert torch.equal(theta, -0.5 * g), kwargs


def test_penalty_scales_by_documented_factor():
    opt = OuterCO2(lr=1.0, momentum=0.0, penalty=True)
    theta = torch.zeros(3)
    opt.step("f", theta, torch.tensor([1.0, 1.0, 1.0]))  # first step: no penalty
    assert opt.last_penalty is None
    # now make coordinate 0 have moved 4x its usual amount
    st = opt.state["f"]
    st["last_update"] = torch.tensor([4.0, 1.0, 0.5])
    st["mean_abs_update"] = torch.tensor([1.0, 1.0, 1.0])
    before = theta.clone()
    opt.step("f", theta, torch.tensor([1.0, 1.0, 1.0]))
    assert torch.allclose(opt.last_penalty, torch.tensor([0.25, 1.0, 1.0]))
    assert torch.allclose(before - theta, torch.tensor([0.25, 1.0, 1.0]))
    assert torch.allclose(
        gap_aware_penalty(torch.tensor([3.0]), torch.tensor([1.5])), torch.tensor([0.5])
    )


def _in_flight_worker(rank: int, world: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.CO2(model, opt, sync_every=3)
    with sync:
        gate = StepGate(sync.transport)  # the engine's transport exists once the block began
        for _ in range(9):
            gate.step()
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        gate.close()  # the last round's exchange: nothing trains after it
    return {"held": gate.held, "done": gate.done, "syncs": sync.stats.syncs}


def test_round_r_collective_in_flight_during_round_r_plus_1(workers):
    for r in workers(_in_flight_worker, 2):
        # the 3 rounds' exchanges (and the exit's) all went to the comm thread and ran there
        # to their end, each only after round r+1's first step had begun
        assert r["syncs"] == 3 and len(r["held"]) == r["done"] >= 3, r
        assert all(r["held"]), r["held"]
