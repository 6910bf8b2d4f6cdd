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
import dataclasses
import json
import os
import resource
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import SyncConfig, TrainConfig
from ..elastic.faults import act, pace, parse_faults
from ..transport import ring_all_reduce_bytes, shutdown
from .log import RunLog
from .model import count_params
from .resume import load_state, restore, save_checkpoint
from .run import Run, init_distributed, lr_lambda, resolve_device, set_up, wrap_for_strategy
from .site_role import SiteRole, record_membership
from .sites import full_state_dict, rows_of
from .summary import RunSummary
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


def run_worker(
    strategy: str,
    sync_cfg: SyncConfig,
    cfg: TrainConfig,
    out_dir: str | Path,
    name: str | None = None,
    resume: str | None = None,
    role: SiteRole | None = None,
) -> dict[str, Any] | None:
    """Train on this process's rank; returns the summary on rank 0 (None elsewhere).

    ``resume`` names a checkpoint folder to continue from
    (see :func:`lowcomm.train.resume.restore`). ``role``: this process is a site of an
    elastic run (:mod:`lowcomm.train.elastic`).
    """
    run = set_up(strategy, sync_cfg, cfg, out_dir, name, role)
    if role is None:
        _write_workers_json(run)  # an elastic run's launcher keeps it
    wrap_for_strategy(run)
    faults = role.faults if role else parse_faults(cfg.faults, run.site.replicas, cfg.steps)
    saved = load_state(run, resume) if resume is not None else None
    if saved is not None:
        run.start_step = int(saved["step"]) + 1
    log = RunLog(
        run.out,
        run.rank,
        start_step=run.start_step,
        total_steps=cfg.steps,
        desc=name or strategy,
        progress=cfg.progress,
        backend=cfg.log,
    )
    if role is not None and role.gate is not None:
        role.gate.wait()  # a joiner on standby: until the site it replaces has left
    try:
        with run.sync_context():
            if saved is not None:
                restore(run, saved)
            if role is not None and role.join:
                _joined(run)
                after_step(run, run.start_step - 1, log)  # the others' control collectives
            step = run.start_step
            run.loop_started = time.perf_counter()
            fresh = saved is None and role is not None and not role.join
            synclog = SyncLog.of(run.out, run.site.replica, run.engine, fresh) if role else None
            while step <= cfg.steps:
                act(faults, run.site.replica, step)
                started, synced = time.perf_counter(), _sync_s(run)
                train_step(run)
                # a slow: fault stretches the step's compute, not the sync inside it
                took = time.perf_counter() - started - (_sync_s(run) - synced)
                pace(faults, run.site.replica, step, took)
                step = _follow(run, step, log)
                if synclog is not None:
                    synclog.after_step(step)
                after_step(run, step, log)
                step += 1
            finish(run)
        summary = summarize(run, log)
    finally:
        log.close()
    _tear_down(run)
    return summary.to_dict() if summary is not None else None


def _sync_s(run: Run) -> float:
    """Seconds the engine has spent in syncs so far, its own work and its waits on the others
    (0 without one)."""
    stats = run.engine.stats if run.engine is not None else None
    return float(stats.outer_s if stats else 0.0) + (run.blocked_s() if stats else 0.0)


def _joined(run: Run) -> None:
    """A site that joined a running run (healed on entering the block) goes on from the run's
    step: its own shard's batches from there and the LR schedule's position; its inner
    optimizer starts fresh."""
    step = run.engine.step
    run.start_step = step + 1
    _go_to(run, step)


def _go_to(run: Run, step: int) -> None:
    """Batches and the LR schedule at the run's ``step`` (a joiner, or a round cut short)."""
    run.batches.step = step
    with warnings.catch_warnings():  # "scheduler stepped before the optimizer": on purpose
        warnings.simplefilter("ignore")
        run.sched.last_epoch = step - 1
        run.sched.step()


def _follow(run: Run, step: int, log: RunLog) -> int:
    """The step this site is at after training ``step``: under quorum rounds the engine may
    have cut the round short (a quorum of sites reached the sync first) and jumped to the
    sync; the skipped steps are counted as done, their batches and LR steps skipped."""
    at = run.engine.step if run.engine is not None else step
    if at <= step:
        return step
    _go_to(run, at)
    for _ in range(at - step):
        log.step_done()
    return at


def train_step(run: Run) -> None:
    """One inner step: forward, backward, optimizer (the engine's outer step runs inside it)."""
    hook = run.hook_state
    with run.clock.segment(run.not_computing_s) as waited:
        x, y = (rows_of(t, run.site) for t in run.batches.next())
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        with run.autocast():
            loss = run.train_model(x, y)
        if hook is not None:
            hook.last_launch = 0.0
        loss.backward()
        if hook is not None and hook.last_launch:
            # backward returned this long after its last bucket was launched: network wait
            waited.append(time_since(hook.last_launch))
        if run.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
        run.opt.step()  # the engine's hook runs the outer step here when due
        run.sched.step()
        run.opt.zero_grad(set_to_none=True)
        run.loss_sum[0] += loss.detach().item()
        run.loss_sum[1] += 1
        if run.device.type == "cuda":
            torch.cuda.synchronize()


def after_step(run: Run, step: int, log: RunLog) -> None:
    """Between steps, outside the timed segments: log, evaluate, checkpoint."""
    cfg = run.cfg
    record: dict[str, Any] | None = None
    if _behind(run):  # out of the run's quorum until its next sync: no collectives with it
        log.step_done()
        return
    if _due(run, step, cfg.log_every) or step == cfg.steps:
        record = _train_record(run, step)
    if step < cfg.steps and cfg.eval_every and _due(run, step, cfg.eval_every):
        record = record or {"step": step, "tokens": step * run.tokens_per_step}
        record["val_loss"] = run.evaluate()
    if cfg.checkpoint_every and _due(run, step, cfg.checkpoint_every):
        run.pending_checkpoint = True
    if run.pending_checkpoint and (run.engine is None or run.engine.last_sync_step == step):
        t0 = time.perf_counter()
        save_checkpoint(run, step)
        run.checkpoint_s += time.perf_counter() - t0
        run.pending_checkpoint = False
    events = run.membership.events if run.membership is not None else []
    if len(events) > run.events_logged:  # a site left: the record marks it
        record = record or {"step": step, "tokens": step * run.tokens_per_step}
        record["membership"] = events[run.events_logged :]
        run.events_logged = len(events)
    if record is not None:
        record["elapsed_s"] = _elapsed(run)
        log.record(record)
    log.step_done()


def _elapsed(run: Run) -> float:
    """Seconds since the training loop began, everything included (logging, evaluation and
    waits outside the timed steps: ``wall_s`` leaves those out)."""
    return round(time.perf_counter() - run.loop_started, 3) if run.loop_started else 0.0


def _behind(run: Run) -> bool:
    """Quorum rounds: this site missed the last sync (it asks back in at its next one); its
    loss sums go with the next record."""
    rounds = getattr(run.membership, "rounds", None)
    return rounds is not None and rounds.stale


def _due(run: Run, step: int, every: int) -> bool:
    """Whether a logging or evaluation due every ``every`` steps falls at ``step``. Under quorum
    rounds these collectives move to the end of the round that holds them: a site cut short
    skips the steps inside a round, and the others must not wait for it there."""
    if run.cfg.rounds != "quorum" or run.engine is None:
        return step % every == 0
    round_steps = run.sync_cfg.sync_every
    return step % round_steps == 0 and step // every > (step - round_steps) // every


def _train_record(run: Run, step: int) -> dict[str, Any]:
    """The metrics record of a logged step: mean train loss since the last one, bytes, times."""
    run.control.all_reduce(run.loss_sum, control=True)
    train_loss = float(run.loss_sum[0] / max(run.loss_sum[1], 1))
    run.loss_sum.zero_()
    totals = run.meter_totals()
    return {
        "step": step,
        "tokens": step * run.tokens_per_step,
        "train_loss": train_loss,
        "lr": run.sched.get_last_lr()[0],
        "bytes_sent": totals.get("sent_bytes", 0),
        "payload_bytes": totals.get("payload_bytes", 0),
        "wall_s": run.clock.wall_s,
        "compute_s": run.clock.compute_s,
        "blocked_s": totals["blocked_s"],
    }


def finish(run: Run) -> None:
    """Drain the engine's in-flight results: the last sync ends the timed loop."""
    if run.engine is not None:
        with run.clock.segment(run.not_computing_s):
            run.engine.finish()


def summarize(run: Run, log: RunLog) -> RunSummary | None:
    """Final evaluation, then the summary over all workers; rank 0 writes its files."""
    val_loss = run.evaluate()
    totals = run.meter_totals()
    log.record(
        {
            "step": run.cfg.steps,
            "tokens": run.cfg.steps * run.tokens_per_step,
            "val_loss": val_loss,
            "wall_s": run.clock.wall_s,
            "elapsed_s": _elapsed(run),
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
            run.clock.wall_s,
            run.clock.compute_s,
            totals["blocked_s"],
            run.inner_meter.sent_bytes,
        ],
        dtype=torch.float64,
    )
    vec = torch.cat([vec, torch.ones(1, dtype=torch.float64)])  # counts the ranks present
    run.control.all_reduce(vec, control=True)
    vec = vec[:-1] / vec[-1]
    rss = torch.tensor(
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64
    )
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    rounds = _rounds_table(run)  # a collective: before the other sites may have left
    state = full_state_dict(run.model)  # a collective when sharded: every rank gathers
    if not run.writes:
        return None
    summary = _build_summary(run, val_loss, vec.tolist(), int(rss.item()))
    if run.checkpoint_s:
        summary.extra["checkpoint_s"] = round(run.checkpoint_s, 3)  # writing them, this site
    if run.membership is not None:
        per_step = run.cfg.batch_size * run.cfg.seq_len
        events = run.membership.events
        starting = run.role.starting if run.role is not None else 0
        record_membership(
            events, run.world, run.cfg.steps, per_step, run.out, summary, starting=starting
        )
    if rounds is not None:
        _record_rounds(summary, rounds, run.cfg.batch_size * run.cfg.seq_len)
    save_model(run, state)
    summary.write(run.out / "summary.json")
    return summary


ROUND_COLUMNS = ("trained_steps", "syncs", "cut_rounds", "cut_steps", "late_syncs")


def _rounds_table(run: Run) -> torch.Tensor | None:
    """Quorum rounds: every site's trained steps, syncs it took part in, rounds cut short,
    steps skipped and syncs missed (one row per site; None in lock-step)."""
    rounds = getattr(run.membership, "rounds", None)
    if run.cfg.rounds != "quorum" or rounds is None:
        return None
    table = torch.zeros((run.world, len(ROUND_COLUMNS)), dtype=torch.float64)
    stats = run.engine.stats
    mine = [
        stats.trained_steps,
        stats.syncs,
        rounds.cut_rounds,
        rounds.cut_steps,
        rounds.late_syncs,
    ]
    table[run.site.replica] = torch.tensor(mine, dtype=torch.float64)
    run.control.all_reduce(table, control=True)
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
    cfg, steps, n_params = run.cfg, run.cfg.steps, count_params(run.model)
    n, replicas = run.site.ranks_per_worker, run.site.replicas
    sent, recv, payload, control_sent, wall, compute, blocked, inner = means
    per_rank = sent
    sent, recv, payload, inner = sent * n, recv * n, payload * n, inner * n
    # per-step strategies too: LoCo's knobs live in the sync config, and a row's command
    # (RunSummary.command) must spell them out
    config = {**dataclasses.asdict(cfg), **dataclasses.asdict(run.sync_cfg)}
    engine = run.engine
    outer = engine.outer if engine is not None else None
    return RunSummary(
        name=run.name or run.strategy,
        strategy=run.strategy,
        workers=replicas,
        params=n_params,
        n_layers=len(getattr(run.model, "blocks", [])),
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
        data=run.corpus,
        torch_version=torch.__version__,
        git_rev=git_rev(),
        device=str(run.device),
        outer_clipped_elements=getattr(outer, "clipped_elements", None),
        outer_penalized_elements=getattr(outer, "penalized_elements", None),
        vocab_size=run.vocab_size,
    )


def save_model(run: Run, state: dict[str, torch.Tensor]) -> None:
    """Write the trained model (the global parameters, identical on every worker) to DIR.

    The one place a run's model files are written: ``model.pt`` (a plain state dict, read back
    by :func:`lowcomm.load_model`) and, for Hugging Face models, ``DIR/hf/`` (read back by
    ``from_pretrained``, with the tokenizer when the run trained one).
    """
    torch.save(state, run.out / "model.pt")
    if hasattr(run.model, "save_pretrained"):
        run.model.save_pretrained(
            run.out / "hf", tokenizer_file=run.tokenizer_file, state_dict=state
        )


def _tear_down(run: Run) -> None:
    """Drop workers.json, wait for every rank, and leave the process group we created."""
    if run.rank == 0:
        with contextlib.suppress(FileNotFoundError):
            (run.out / "workers.json").unlink()
    dist.barrier()
    if run.owns_group:
        # Tear gloo down while the interpreter is whole (see transport.shutdown): left to exit,
        # its threads can abort the process after the summary was written.
        shutdown()


def _write_workers_json(run: Run) -> None:
    """DIR/workers.json: rank and pid of each live local worker, for operators and scripts."""
    entries: list[Any] = [None] * run.world
    me = {"rank": run.rank, "pid": os.getpid(), "host": os.uname().nodename}
    dist.all_gather_object(entries, me)
    if run.rank == 0:
        tmp = run.out / "workers.json.tmp"
        tmp.write_text(json.dumps(entries, indent=2) + "\n")
        tmp.replace(run.out / "workers.json")


def time_since(t: float) -> float:
    """Seconds elapsed since the ``time.perf_counter()`` reading ``t``."""
    return time.perf_counter() - t


def git_rev() -> str:
    """The source tree's git revision (with -dirty), LOWCOMM_GIT_REV if set, or 'unknown'."""
    if os.environ.get("LOWCOMM_GIT_REV"):  # benchmarks run from a snapshot of the tree
        return os.environ["LOWCOMM_GIT_REV"]
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5
        ).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
