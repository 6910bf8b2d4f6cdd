"""The reference trainer: one worker's training run, for every strategy, as a few named steps.

:func:`run_worker` reads top to bottom: set up the run (:mod:`lowcomm.train.run`), wrap it for
the strategy, restore a checkpoint if asked, then for each step :func:`train_step` and
:func:`after_step` (log, evaluate, checkpoint), then :func:`finish` and :func:`summarize`.
Per-step strategies (``ddp``, ``loco``) train through DistributedDataParallel with a metered
comm hook; the others run the unchanged loop inside the engine's ``with`` block. Rank 0 writes
``metrics.jsonl``, ``summary.json`` and ``model.pt`` (fields in docs/design.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
import warnings
from typing import Any

import torch

from ..errors import MembershipError
from ..provenance import git_rev
from ..transport import Transport, ring_all_reduce_bytes, shutdown
from .callbacks import Callbacks
from .log import RunLog
from .model import count_params
from .resume import load_state, restore, save_checkpoint
from .run import Run, init_distributed, lr_lambda, resolve_device, set_up, wrap_for_strategy
from .site_role import FIXED_WORLD, ElasticSite, record_membership
from .sites import full_state_dict, rows_of
from .spec import RunSpec
from .summary import RunSummary, written_since
from .synclog import SyncLog

__all__ = [
    "run_worker",
    "train_step",
    "after_step",
    "finish",
    "summarize",
    "save_model",
    "init_distributed",
    "resolve_device",
    "lr_lambda",
    "git_rev",
]


def run_worker(spec: RunSpec, role: ElasticSite | None = None) -> dict[str, Any] | None:
    """Train on this process's rank; returns the summary on rank 0 (None elsewhere).

    ``spec.resume`` names a checkpoint folder to continue from
    (see :func:`lowcomm.train.resume.restore`). ``role``: this process is a site of an
    elastic run (:mod:`lowcomm.train.elastic`).
    """
    cfg = spec.train
    place = role or FIXED_WORLD
    began = time.time()  # a summary of the run's folder newer than this is of this run
    run = set_up(spec, place)
    if not place.elastic:
        _write_workers_json(run)  # an elastic run's launcher keeps it
    site, starting = run.place.site, place.starting or run.place.site.replicas
    run.callbacks = Callbacks(
        [
            cb
            for ext in spec.extensions.values()
            for cb in ext.callbacks(spec, site.replica, starting)
        ]
    )
    wrap_for_strategy(run)
    saved = load_state(run, spec.resume) if spec.resume is not None else None
    if saved is not None:
        run.progress.start_step = int(saved["step"]) + 1
    alone = place.alone  # launched on its own: its folder is its own
    log = RunLog(
        spec.out,
        run.place.site.part if alone else run.place.rank,  # alone: the site's first rank writes
        append=alone,
        start_step=run.progress.start_step,
        total_steps=cfg.steps,
        desc=spec.label,
        progress=cfg.progress,
        backend=cfg.log,
    )
    if place.staged.gate is not None:
        place.staged.gate.wait()  # a joiner on standby: until the site it replaces has left
    try:
        with run.sync_context():
            if saved is not None:
                restore(run, saved)
            healed = place.elastic and _healed(run)
            if healed:
                _joined(run)
                after_step(run, run.progress.start_step - 1, log)  # the others' collectives
            _train_loop(run, log, fresh=saved is None and not healed)
            finish(run)
        summary = summarize(run, log, began)
        ended = getattr(run.membership, "ended", None)
        if ended is not None:  # its last collective done: a site still away must not go on
            ended()  # alone
    finally:
        log.close()
    _tear_down(run)
    if summary is not None and summary.extra.get("apart"):  # after every rank is done
        raise MembershipError(summary.extra["apart"])
    return summary.to_dict() if summary is not None else None


def _train_loop(run: Run, log: RunLog, fresh: bool) -> None:
    """Every inner step from the start step to the last, the run's callbacks told before and
    after each; ``fresh``: neither resumed nor healed (a starting elastic site begins its sync
    record afresh)."""
    role, replica, steps = run.place.role, run.place.site.replica, run.spec.train.steps
    step = run.progress.start_step
    log.begin()
    synclog = None
    if role.elastic and not run.spec.strategy.peer:  # a peer's engine has no global copy
        synclog = SyncLog(run.spec.out, replica, run.comm.engine, fresh, run.place.site.part)
    while step <= steps:
        run.callbacks.on_step_begin(step)
        started, synced = time.perf_counter(), _sync_s(run)
        train_step(run)
        # the step's compute, not the sync inside it
        took = time.perf_counter() - started - (_sync_s(run) - synced)
        run.callbacks.on_step_end(step, took)
        step = _follow(run, step, log)
        if synclog is not None:
            synclog.after_step(step)
        after_step(run, step, log)
        step += 1


def _sync_s(run: Run) -> float:
    """Seconds the engine has spent in syncs so far, its own work and its waits on the others
    (0 without one)."""
    stats = run.comm.engine.stats if run.comm.engine is not None else None
    return float(stats.outer_s if stats else 0.0) + (run.comm.blocked_s() if stats else 0.0)


def _healed(run: Run) -> bool:
    """Whether this site joined a running run (a joiner, or a site launched on its own that
    found the run going): it healed on entering the block."""
    role = run.place.role
    return role.elastic and getattr(run.comm.engine, "healed", role.join)


def _joined(run: Run) -> None:
    """A site that joined a running run (healed on entering the block) goes on from the run's
    step: its own shard's batches from there and the LR schedule's position; its inner
    optimizer starts fresh."""
    step = run.comm.engine.step
    run.progress.start_step = step + 1
    _go_to(run, step)


def _go_to(run: Run, step: int) -> None:
    """Batches and the LR schedule at the run's ``step`` (a joiner, or a round cut short)."""
    run.data.batches.step = step
    with warnings.catch_warnings():  # "scheduler stepped before the optimizer": on purpose
        warnings.simplefilter("ignore")
        run.learner.sched.last_epoch = step - 1
        run.learner.sched.step()


def _follow(run: Run, step: int, log: RunLog) -> int:
    """The step this site is at after training ``step``: under quorum rounds the engine may
    have cut the round short (a quorum of sites reached the sync first) and jumped to the
    sync; the skipped steps are counted as done, their batches and LR steps skipped."""
    at = run.comm.engine.step if run.comm.engine is not None else step
    if at <= step:
        return step
    _go_to(run, at)
    for _ in range(at - step):
        log.step_done()
    return at


def train_step(run: Run) -> None:
    """One inner step: forward, backward, optimizer (the engine's outer step runs inside it)."""
    hook, learner, device = run.comm.hook_state, run.learner, run.place.device
    clip = run.spec.train.grad_clip
    with run.progress.clock.segment(run.not_computing_s) as waited:
        x, y = (rows_of(t, run.place.site) for t in run.data.batches.next())
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with run.autocast():
            loss = learner.train_model(x, y)
        if hook is not None:
            hook.last_launch = 0.0
        loss.backward()
        if hook is not None and hook.last_launch:
            # backward returned this long after its last bucket was launched: network wait
            waited.append(time_since(hook.last_launch))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(learner.model.parameters(), clip)
        learner.opt.step()  # the engine's hook runs the outer step here when due
        learner.sched.step()
        learner.opt.zero_grad(set_to_none=True)
        # summed where the loss is (no host sync per step); read when a record is logged
        run.progress.loss_sum[0] += loss.detach().double()
        run.progress.loss_sum[1] += 1
        if device.type == "cuda":
            # the one host sync per step, on purpose: the clock times the step's kernels, not
            # their launches (compute_s and the utilization are defined by that time)
            torch.cuda.synchronize()


def after_step(run: Run, step: int, log: RunLog) -> None:
    """Between steps, outside the timed segments: log, evaluate, checkpoint."""
    cfg = run.spec.train
    record: dict[str, Any] | None = None
    if _behind(run):  # out of the run's quorum until its next sync: no collectives with it
        log.step_done()
        return
    rounds = _round_steps(run)
    logs = _due(step, cfg.log_every, rounds) or step == cfg.steps
    evaluates = step < cfg.steps and cfg.eval_every and _due(step, cfg.eval_every, rounds)
    if cfg.checkpoint_every and _due(step, cfg.checkpoint_every, rounds):
        run.progress.pending_checkpoint = True
    if logs:
        record = _train_record(run, step)
    if evaluates:
        record = record or {"step": step, "tokens": step * run.tokens_per_step}
        record["val_loss"] = run.evaluate()
    if run.progress.pending_checkpoint and (
        run.comm.engine is None or run.comm.engine.last_sync_step == step
    ):
        t0 = time.perf_counter()
        save_checkpoint(run, step)
        run.progress.checkpoint_s += time.perf_counter() - t0
        run.progress.pending_checkpoint = False
    events = run.membership.events if run.membership is not None else []
    if len(events) > run.progress.events_logged:  # a site left: the record marks it
        record = record or {"step": step, "tokens": step * run.tokens_per_step}
        record["membership"] = events[run.progress.events_logged :]
        run.progress.events_logged = len(events)
    if record is not None:
        log.record(record)
    log.step_done()


def _behind(run: Run) -> bool:
    """Quorum rounds: this site missed the last sync (it asks back in at its next one); its
    loss sums go with the next record."""
    rounds = getattr(run.membership, "rounds", None)
    return rounds is not None and rounds.stale


def _round_steps(run: Run) -> int:
    """Quorum rounds: the steps of a round (0 in lock-step, or without an engine)."""
    quorum = run.spec.elastic and run.spec.membership.rounds == "quorum"
    return run.spec.sync.sync_every if quorum and run.comm.engine is not None else 0


def _due(step: int, every: int, round_steps: int = 0) -> bool:
    """Whether a logging or evaluation due every ``every`` steps falls at ``step``. Under quorum
    rounds (rounds of ``round_steps``) these collectives move to the end of the round that
    holds them: a site cut short skips the steps inside a round, and the others must not wait
    for it there."""
    if not round_steps:
        return step % every == 0
    return step % round_steps == 0 and step // every > (step - round_steps) // every


def _train_record(run: Run, step: int) -> dict[str, Any]:
    """The metrics record of a logged step: mean train loss since the last one, bytes, times."""
    run.comm.control.all_reduce(run.progress.loss_sum, control=True)
    total, count = run.progress.loss_sum.tolist()
    train_loss = total / max(count, 1)
    run.progress.loss_sum.zero_()
    totals = run.meter_totals()
    return {
        "step": step,
        "tokens": step * run.tokens_per_step,
        "train_loss": train_loss,
        "lr": run.learner.sched.get_last_lr()[0],
        "bytes_sent": totals.get("sent_bytes", 0),
        "payload_bytes": totals.get("payload_bytes", 0),
        "wall_s": run.progress.clock.wall_s,
        "compute_s": run.progress.clock.compute_s,
        "blocked_s": totals["blocked_s"],
    }


def finish(run: Run) -> None:
    """Drain the engine's in-flight results: the last sync ends the timed loop."""
    if run.comm.engine is not None:
        with run.progress.clock.segment(run.not_computing_s):
            run.comm.engine.finish()


def summarize(run: Run, log: RunLog, began: float = 0.0) -> RunSummary | None:
    """Final evaluation, then the summary over all workers; rank 0 writes its files (a site
    that finds the run's summary written since ``began``, by another site, writes beside it
    and stops: see :func:`_finished_without`)."""
    rounds = _rounds_table(run)  # a collective: before the other sites may have left
    val_loss = run.evaluate()
    totals = run.meter_totals()
    log.record(
        {
            "step": run.spec.train.steps,
            "tokens": run.spec.train.steps * run.tokens_per_step,
            "val_loss": val_loss,
            "wall_s": run.progress.clock.wall_s,
            "final": True,
        }
    )
    # per-worker figures averaged over workers; peak memory is the max
    vec = torch.tensor(
        [
            totals.get("sent_bytes", 0),
            totals.get("received_bytes", 0),
            totals.get("payload_bytes", 0),
            totals["control_sent_bytes"],
            run.progress.clock.wall_s,
            run.progress.clock.compute_s,
            totals["blocked_s"],
            run.comm.inner_meter.sent_bytes,
        ],
        dtype=torch.float64,
    )
    vec = torch.cat([vec, torch.ones(1, dtype=torch.float64)])  # counts the ranks present
    run.comm.control.all_reduce(vec, control=True)
    vec = vec[:-1] / vec[-1]
    rss = torch.tensor(
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64
    )
    Transport().all_reduce(rss, control=True, op="max")  # this process's world
    state = full_state_dict(run.learner.model)  # a collective when sharded: every rank gathers
    if not run.writes:
        return None
    summary = _build_summary(run, val_loss, vec.tolist(), int(rss.item()))
    if run.progress.checkpoint_s:
        # writing them, this site
        summary.extra["checkpoint_s"] = round(run.progress.checkpoint_s, 3)
    if run.membership is not None:
        per_step = run.spec.train.batch_size * run.spec.train.seq_len
        events = run.membership.events
        starting = run.place.role.starting
        record_membership(
            events,
            run.place.site.replicas,  # the sites (a site of several ranks counts once)
            run.spec.train.steps,
            per_step,
            run.spec.out,
            summary,
            starting=starting,
        )
        # messages without a valid MAC (a run secret's screen) this site read and ignored
        admission = getattr(getattr(run.membership, "membership", None), "admission", None)
        if admission is not None:
            summary.extra["ignored_messages"] = admission.ignored
    if rounds is not None:
        _record_rounds(summary, rounds, run.spec.train.batch_size * run.spec.train.seq_len)
    if _finished_without(run, began):
        _write_apart(run, state, summary)
        return summary
    save_model(run, state)
    summary.write(run.spec.out / "summary.json")
    return summary


def _finished_without(run: Run, began: float) -> bool:
    """Whether, in a folder the sites share, another site wrote the run's summary since this
    one began: the run ended without this site, which then trained on apart from it (sites
    left out together and back after the others finished find only each other at the
    lighthouse), so what it holds is not the run's model."""
    role = run.place.role
    if not isinstance(role, ElasticSite) or role.alone or not began:
        return False
    return written_since(run.spec.out, began)


def _write_apart(run: Run, state: dict[str, torch.Tensor], summary: RunSummary) -> None:
    """This site's model and summary beside the run's (``model.siteN.pt``,
    ``summary.siteN.json``), never over them; ``summary.extra["apart"]`` holds the line it
    stops with (once every rank is done)."""
    role = run.place.role
    assert isinstance(role, ElasticSite)  # see _finished_without
    site, out = role.site, run.spec.out
    summary.extra["apart"] = (
        f"site {site}: the run was finished by other sites while this one was apart from it "
        f"(left out, then back after they ended), and it trained on with the sites it found; "
        f"its model is not the run's: it is in {out / f'model.site{site}.pt'}, the run's "
        f"model.pt and summary.json are the others'"
    )
    torch.save(state, out / f"model.site{site}.pt")
    summary.write(out / f"summary.site{site}.json")


ROUND_COLUMNS = ("trained_steps", "syncs", "cut_rounds", "cut_steps", "late_syncs")


def _rounds_table(run: Run) -> torch.Tensor | None:
    """Quorum rounds: every site's trained steps, syncs it took part in, rounds cut short,
    steps skipped and syncs missed (one row per site; None in lock-step)."""
    rounds = getattr(run.membership, "rounds", None)
    if rounds is None or not _round_steps(run):
        return None
    table = torch.zeros((run.place.world, len(ROUND_COLUMNS)), dtype=torch.float64)
    stats = run.comm.engine.stats
    mine = [
        stats.trained_steps,
        stats.syncs,
        rounds.cut_rounds,
        rounds.cut_steps,
        rounds.late_syncs,
    ]
    table[run.place.site.replica] = torch.tensor(mine, dtype=torch.float64)
    run.comm.control.all_reduce(table, control=True)
    return table


def _record_rounds(summary: RunSummary, table: torch.Tensor, tokens_per_site_step: int) -> None:
    """The summary's ``tokens`` are what the sites trained (a round cut short trains fewer
    steps); per-site figures go under ``extra["rounds"]``."""
    rows = table.long().tolist()
    summary.tokens = sum(r[0] for r in rows) * tokens_per_site_step
    summary.extra["rounds"] = {c: [r[i] for r in rows] for i, c in enumerate(ROUND_COLUMNS)}
    wall = summary.wall_s or 0.0
    summary.extra["goodput"] = summary.tokens / wall if wall > 0 else 0.0


def _build_summary(run: Run, val_loss: float, means: list[float], rss: int) -> RunSummary:
    """The RunSummary of this run from the ranks' mean figures (see :func:`summarize`); byte
    figures per worker are its ranks' together."""
    cfg, steps, n_params = run.spec.train, run.spec.train.steps, count_params(run.learner.model)
    n, replicas = run.place.site.ranks_per_worker, run.place.site.replicas
    sent, recv, payload, control_sent, wall, compute, blocked, inner = means
    per_rank = sent
    sent, recv, payload, inner = sent * n, recv * n, payload * n, inner * n
    # per-step strategies too: LoCo's knobs live in the sync config, and a row's command
    # (RunSummary.command) must spell them out
    config = run.spec.configs().flat()
    engine = run.comm.engine
    outer = engine.outer if engine is not None else None
    return RunSummary(
        name=run.spec.label,
        strategy=run.spec.strategy.name,
        workers=replicas,
        params=n_params,
        n_layers=len(getattr(run.learner.model, "blocks", [])),
        tokens=steps * run.tokens_per_step,
        inner_steps=steps,
        final_val_loss=val_loss,
        bytes_sent_per_worker=int(sent),
        bytes_received_per_worker=int(recv),
        payload_bytes_per_worker=int(payload),
        ddp_fp32_bytes_per_worker=int(steps * ring_all_reduce_bytes(4 * n_params, replicas)),
        control_bytes_per_worker=int(control_sent),
        ranks_per_worker=n,
        bytes_sent_per_rank=int(per_rank),
        inner_bytes_sent_per_worker=int(inner),
        syncs=engine.stats.syncs if engine is not None else steps,
        # per-step strategies send every step: their "sync" is one step's traffic
        peak_bytes_per_sync=(
            engine.stats.peak_bytes_per_sync * n if engine is not None else int(sent / steps)
        ),
        wall_s=wall,
        compute_s=compute,
        blocked_s=blocked,
        compute_utilization=compute / wall if wall > 0 else 0.0,
        step_compute_s=compute / steps,
        peak_rss_bytes=rss,
        seed=cfg.seed,
        config=config,
        data=run.data.description,
        torch_version=torch.__version__,
        git_rev=git_rev(),
        device=str(run.place.device),
        outer_clipped_elements=getattr(outer, "clipped_elements", None),
        outer_penalized_elements=getattr(outer, "penalized_elements", None),
        vocab_size=run.learner.vocab_size,
    )


def save_model(run: Run, state: dict[str, torch.Tensor]) -> None:
    """Write the trained model (the global parameters, identical on every worker) to DIR.

    The one place a run's model files are written: ``model.pt`` (a plain state dict, read back
    by :func:`lowcomm.load_model`) and, for Hugging Face models, ``DIR/hf/`` (read back by
    ``from_pretrained``, with the tokenizer when the run trained one).
    """
    torch.save(state, run.spec.out / "model.pt")
    if hasattr(run.learner.model, "save_pretrained"):
        run.learner.model.save_pretrained(
            run.spec.out / "hf", tokenizer_file=run.data.tokenizer_file, state_dict=state
        )


def _tear_down(run: Run) -> None:
    """Drop workers.json, wait for every rank, and leave the process group we created."""
    if run.place.rank == 0:
        with contextlib.suppress(FileNotFoundError):
            (run.spec.out / "workers.json").unlink()
    Transport().barrier()
    if run.place.owns_group:
        # Tear gloo down while the interpreter is whole (see transport.shutdown): left to exit,
        # its threads can abort the process after the summary was written.
        shutdown()


def _write_workers_json(run: Run) -> None:
    """DIR/workers.json: rank and pid of each live local worker, for operators and scripts."""
    me = {"rank": run.place.rank, "pid": os.getpid(), "host": os.uname().nodename}
    entries = Transport().all_gather_object(me)
    if run.place.rank == 0:
        tmp = run.spec.out / "workers.json.tmp"
        tmp.write_text(json.dumps(entries, indent=2) + "\n")
        tmp.replace(run.spec.out / "workers.json")


def time_since(t: float) -> float:
    """Seconds elapsed since the ``time.perf_counter()`` reading ``t``."""
    return time.perf_counter() - t
