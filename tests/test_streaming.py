"""Streaming DiLoCo in the engine: fragments, overlap tau, alpha merge, against plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import StepGate, adamw, batches, flat_params, local_steps, tiny_model

import lowcomm

STEPS = 14


def _train(rank, world, steps, make_sync, gates=None):
    """``gates``: a list that gets the StepGate that held each comm-thread job."""
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = make_sync(model, opt)
    with sync:
        # the engine's transport exists once the block began
        gate = StepGate(sync.transport) if gates is not None else None
        for _ in range(steps):
            if gate is not None:
                gate.step()
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if gate is not None:
            gate.close()  # the last sends' jobs: nothing trains after them
            gates.append(gate)
    return model, sync


def _p1_vs_diloco_worker(rank: int, world: int) -> dict:
    a, _ = _train(rank, world, 12, lambda m, o: lowcomm.DiLoCo(m, o, sync_every=4, outer_lr=0.7))
    b, _ = _train(
        rank,
        world,
        12,
        lambda m, o: lowcomm.StreamingDiLoCo(
            m,
            o,
            sync_every=4,
            outer_lr=0.7,
            fragments=1,
            blocks_per_fragment=0,
            overlap=0,
            codec="fp32",
        ),
    )
    return {"diloco": flat_params(a), "streaming": flat_params(b)}


def test_streaming_p1_tau0_fp32_is_diloco_exactly(workers):
    res = workers(_p1_vs_diloco_worker, 2)
    for r in res:
        assert torch.equal(r["diloco"], r["streaming"])


def _streaming_worker(
    rank: int,
    world: int,
    H: int,
    P: int,
    tau: int,
    alpha: float,
    steps: int = STEPS,
    codec: str = "fp32",
) -> dict:
    model, sync = _train(
        rank,
        world,
        steps,
        lambda m, o: lowcomm.StreamingDiLoCo(
            m,
            o,
            sync_every=H,
            fragments=P,
            blocks_per_fragment=0,
            overlap=tau,
            alpha=alpha,
            codec=codec,
            outer_lr=0.7,
            outer_momentum=0.9,
        ),
    )
    return {
        "global": {k: v.clone() for k, v in sync.global_state().items()},
        "fragments": sync.fragment_names,
    }


def reference_streaming(world, H, P, tau, alpha, steps=STEPS):
    """docs/algorithms.md §2 in plain torch: M model copies stepped in lockstep,
    one SGD per fragment.

    At the end: results in flight are applied, then one more outer step for each fragment that
    trained after both its last send and its last applied result (a result applied at or after
    the last inner step leaves nothing for another step: the merge took the steps in flight).
    """
    init = tiny_model(seed=0)
    names = [n for n, _ in init.named_parameters()]
    blocks = len(init.blocks)
    if P == 1:
        frags = [names]
    else:  # embeddings+norm+head, then blocks strided over the other P-1 fragments
        frags = [[n for n in names if not n.startswith("blocks.")]]
        frags += [
            [n for n in names if any(n.startswith(f"blocks.{b}.") for b in range(g, blocks, P - 1))]
            for g in range(P - 1)
        ]
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [adamw(m) for m in models]
    data = [batches(r, world) for r in range(world)]
    params = [dict(m.named_parameters()) for m in models]
    glob = {n: p.detach().clone() for n, p in init.named_parameters()}
    outer = [
        torch.optim.SGD([glob[n] for n in f], lr=0.7, momentum=0.9, nesterov=True) for f in frags
    ]
    pending = {}
    last_sent = [0] * P
    last_applied = [0] * P

    def apply(p, avg):
        for n in frags[p]:
            glob[n].grad = avg[n]
        outer[p].step()
        with torch.no_grad():
            for n in frags[p]:
                for w in range(world):
                    a = alpha if tau > 0 else 0.0
                    params[w][n].copy_(a * params[w][n] + (1 - a) * glob[n])

    for t in range(1, steps + 1):
        for m, o, d in zip(models, opts, data):
            x, y = d.next()
            m(x, y).backward()
            o.step()
            o.zero_grad()
        for p in range(P):
            if (t - (p * H) // P) % H == 0:
                last_sent[p] = t
                avg = {
                    n: torch.stack([glob[n] - params[w][n].detach() for w in range(world)]).mean(0)
                    for n in frags[p]
                }
                pending[p] = (avg, t + tau)
        for p in sorted(pending):
            avg, at = pending[p]
            if at == t:
                del pending[p]
                apply(p, avg)
                last_applied[p] = t
    for p in sorted(pending):  # the end: apply what is in flight, after the last step
        apply(p, pending.pop(p)[0])
        last_applied[p] = steps
    for p in range(P):
        if last_sent[p] < steps and last_applied[p] < steps:
            apply(
                p,
                {
                    n: torch.stack([glob[n] - params[w][n].detach() for w in range(world)]).mean(0)
                    for n in frags[p]
                },
            )
    return glob, frags


@pytest.mark.parametrize(
    "H,P,tau,alpha,steps",
    [
        (6, 3, 1, 0.5, STEPS),
        # fragment 0's last result lands on the last step (14): no outer step after it
        (6, 2, 2, 0.0, STEPS),
        pytest.param(4, 3, 0, 0.0, STEPS, marks=pytest.mark.slow),  # tau = 0: by hand
        # the send at step 24 lands after the end (drained): no outer step after it, any alpha
        (8, 2, 2, 0.0, 25),
        (8, 2, 2, 0.5, 25),
    ],
)
def test_streaming_matches_plain_torch(workers, H, P, tau, alpha, steps):
    res = workers(_streaming_worker, 2, H, P, tau, alpha, steps)
    torch.set_num_threads(1)
    glob, frags = reference_streaming(2, H, P, tau, alpha, steps)
    assert res[0]["fragments"] == frags
    for r in res:
        for n, v in glob.items():
            torch.testing.assert_close(r["global"][n], v.detach(), atol=1e-6, rtol=0, msg=n)


def _overlap_worker(rank: int, world: int) -> dict:
    gates: list[StepGate] = []
    model, sync = _train(
        rank,
        world,
        12,
        lambda m, o: lowcomm.StreamingDiLoCo(
            m, o, sync_every=6, fragments=2, blocks_per_fragment=0, overlap=2, codec="fp32"
        ),
        gates=gates,
    )
    return {"held": gates[0].held, "done": gates[0].done}


def test_collective_in_flight_while_training_continues(workers):
    """Each fragment's exchange runs on the comm thread only once a later inner step has
    begun: had the engine waited for it, that step would never begin (see StepGate)."""
    res = workers(_overlap_worker, 2)
    for r in res:
        # the exchanges handed to the comm thread while training (sends that land after the
        # last step are drained on leaving the block): each one held there, and ran to its end
        assert len(r["held"]) == r["done"] >= 3 and all(r["held"]), r


def _streamed_topk_worker(rank: int, world: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.StreamingDiLoCo(
        model,
        opt,
        sync_every=6,
        fragments=2,
        blocks_per_fragment=0,
        overlap=1,
        alpha=0.5,
        codec="topk",
        density=1 / 16,
        compensation="ef",
        reduce="gather",
        outer_optimizer="sgd",
        outer_lr=1.0,
    )
    x0, y0 = batches(0, 1).batch(10_000)
    with sync:
        for _ in range(36):
            x, y = data.next()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        final = model(x0, y0).item()
    return {"global": sync.global_flat(), "final": final, "stats": sync.stats.as_dict()}


def test_streamed_topk_with_error_feedback_end_to_end(workers):
    """A combination nobody ships: SparseLoCo's codec and error feedback, streamed with overlap."""
    res = workers(_streamed_topk_worker, 2)
    assert torch.equal(res[0]["global"], res[1]["global"])
    st = res[0]["stats"]
    assert st["fragment_syncs"] == 12 and st["bytes_sent"] > 0
    model = tiny_model(seed=0)
    x0, y0 = batches(0, 1).batch(10_000)
    with torch.no_grad():
        initial = model(x0, y0).item()
    assert res[0]["final"] < initial - 0.2  # it trains (sparse outer steps: slower than dense)


def _continue_worker(rank: int, world: int, steps: int) -> dict:
    model, sync = _train(
        rank,
        world,
        steps,
        lambda m, o: lowcomm.StreamingDiLoCo(
            m,
            o,
            sync_every=6,
            fragments=1,
            blocks_per_fragment=0,
            overlap=2,
            merge="continue",
            codec="fp32",
            outer_lr=0.7,
            outer_momentum=0.9,
        ),
    )
    return {"global": sync.global_flat().clone()}


def reference_continue(world: int, steps: int, H: int = 6, tau: int = 2) -> torch.Tensor:
    """Overlapped DiLoCo with the continue merge, written as the rule reads: when a result lands,
    theta <- new global + (the steps taken since the send); at the end drain, then one more outer
    step over the steps not yet sent."""
    init = tiny_model(seed=0)
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [adamw(m) for m in models]
    data = [batches(r, world) for r in range(world)]
    glob = [p.detach().clone() for p in init.parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    pending = None  # (average, weights at the send, apply step)

    def vec(m):
        return torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()

    def outer_step(avg):
        for g, a in zip(glob, torch.split(avg, [g.numel() for g in glob])):
            g.grad = a.view_as(g).clone()
        outer.step()

    def land():
        avg, at_send, _ = pending
        outer_step(avg)
        new = torch.nn.utils.parameters_to_vector(glob).detach()
        for m, sent in zip(models, at_send):
            torch.nn.utils.vector_to_parameters(new + (vec(m) - sent), m.parameters())

    last_send = 0
    for t in range(1, steps + 1):
        for m, o, d in zip(models, opts, data):
            local_steps(m, o, d, 1)
        g = torch.nn.utils.parameters_to_vector(glob).detach()
        if pending is not None and pending[2] == t:
            land()  # (never at a send step here: tau < H)
            pending = None
        if t % H == 0:
            pending = (
                torch.stack([g - vec(m) for m in models]).mean(0),
                [vec(m) for m in models],
                t + tau,
            )
            last_send = t
    if pending is not None:
        land()
    if last_send < steps:
        g = torch.nn.utils.parameters_to_vector(glob).detach()
        outer_step(torch.stack([g - vec(m) for m in models]).mean(0))
    return torch.nn.utils.parameters_to_vector(glob).detach()


def test_continue_merge_matches_plain_torch(workers):
    res = workers(_continue_worker, 2, 13)
    torch.set_num_threads(1)
    expected = reference_continue(2, 13)
    for r in res:
        torch.testing.assert_close(r["global"], expected, atol=1e-6, rtol=0)
