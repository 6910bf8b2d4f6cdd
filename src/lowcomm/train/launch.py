"""Start the workers of a run: M local processes through torch's elastic launcher, or, under
``torchrun``, the world torchrun already made (so multi-node needs no extra code)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, TrainConfig
from ..errors import LowCommError
from .elastic import SitesFailed, check_elastic, replay_joins, replay_leaves, run_sites
from .entry import clear_stale, error_file, failure_of, run_entry, user_errors
from .ports import check_port, free_port
from .spec import RunSpec

if TYPE_CHECKING:
    from .site_role import ElasticSite


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and the cause."""

    def __init__(self, message: str, exitcode: int = 1) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def under_torchrun() -> bool:
    """True when this process is one worker of a world started by torchrun (or similar)."""
    env = os.environ
    return "RANK" in env and "WORLD_SIZE" in env and "LOWCOMM_LAUNCHED" not in env


class Interrupted(LaunchError):
    """The run was stopped by a signal (Ctrl-C); the message says where to resume from."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 130)


def _entry(spec: RunSpec) -> Any:
    from .loop import run_worker

    rank = os.environ.get("RANK", "0")
    return run_entry(str(spec.out), rank, lambda: run_worker(spec))


_error_file, _user_errors = error_file, user_errors  # the names tests and callers know


def preflight(spec: RunSpec, workers: int) -> list[str]:
    """Check device, model, fragment schedule and data before any worker starts.

    Raises ConfigError for what cannot work; returns warnings (e.g. a corpus read many times
    over) for the caller to print once.
    """
    import torch

    from .log import check_log_backend

    cfg = spec.train
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available: use device=cpu")
    if cfg.device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device={cfg.device!r}: choose auto, cpu, cuda or cuda:N")
    check_log_backend(cfg.log)
    check_gpu_shape(cfg, local_ranks(workers * cfg.ranks_per_worker))
    spec.strategy.check_sites(cfg)
    warnings = []
    vocab = 256
    if cfg.data.startswith("hf:") and importlib.util.find_spec("datasets") is None:
        raise ConfigError(
            f"data={cfg.data} needs the Hugging Face datasets package: pip install 'lowcomm[hf]'"
        )
    if cfg.data not in ("stdlib", "") and not cfg.data.startswith("hf:"):
        corpus = _check_data(cfg, workers)
        vocab = corpus.vocab_size
        warn = _repeat_warning(corpus, cfg, workers)
        if warn:
            warnings.append(warn)
    _check_schedule(spec, vocab)
    return warnings


def local_ranks(launched: int) -> int:
    """How many ranks run on this machine: torchrun's per-node count, else what we launch."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", launched)) if under_torchrun() else launched


def check_gpu_shape(cfg: TrainConfig, ranks: int) -> None:
    """A shape that cannot run on this machine's GPUs, refused before any worker starts.

    Workers of one rank may share a GPU (their groups are gloo then); ranks inside a worker
    (FSDP2 or DDP over ``ranks_per_worker``) talk over NCCL, which needs a GPU per rank.
    """
    from .run import gpus_for

    gpus, n = gpus_for(cfg.device), cfg.ranks_per_worker
    if gpus == 0 or n == 1 or ranks <= gpus:
        return
    workers = max(1, gpus // n)
    raise ConfigError(
        f"ranks_per_worker={n} runs FSDP2 (or DDP) inside each worker over NCCL, which needs a "
        f"GPU per rank, but {ranks} ranks would share this machine's {gpus} GPU"
        f"{'s' if gpus > 1 else ''} (device={cfg.device}): start at most {gpus} ranks here "
        f"(--workers {workers} ranks_per_worker={min(n, gpus)}), or ranks_per_worker=1 (workers "
        f"of one rank may share a GPU)"
    )


def _check_data(cfg: TrainConfig, workers: int) -> Any:
    """Load the corpus once here, and cut it as the workers will, so its errors come first."""
    from .data import Batches, load_corpus, val_batches

    corpus = load_corpus(cfg.data)
    Batches(corpus.train, cfg.batch_size, cfg.seq_len, 0, workers, cfg.seed, shard=cfg.shard)
    val_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, seed=cfg.seed)
    return corpus


def _repeat_warning(corpus: Any, cfg: TrainConfig, workers: int) -> str | None:
    from .data import repeat_warning

    return repeat_warning(corpus, cfg.steps * cfg.batch_size * cfg.seq_len * workers)


def _check_schedule(spec: RunSpec, vocab: int) -> None:
    """Build the model without memory (meta device) and the strategy's schedule on it."""
    import torch

    from .build import build_model

    cfg = spec.train
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, vocab_size=vocab, max_seq_len=max(cfg.seq_len, 1))
    except LowCommError:
        raise
    except Exception:  # a model that cannot be built without memory: the workers check it
        return
    spec.strategy.check_schedule(model, spec.sync)


def launch(
    spec: RunSpec,
    workers: int,
    port: int | None = None,
    on_checked: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Run a training job; returns rank 0's summary (None on other ranks under torchrun).

    ``spec.resume`` is a checkpoint folder (from :func:`find_resume`) to continue from. Config,
    device, model, schedule and data errors are raised here, before any worker starts;
    ``on_checked`` runs once they have passed, just before the workers start.
    """
    cfg = spec.train
    spec.strategy.check(spec.sync, cfg, spec.resume)
    if spec.membership.site >= 0:  # one site of a run, launched on its own (site=N sites=S)
        return _own_site(spec, on_checked)
    if under_torchrun():
        return _under_torchrun(spec, on_checked)
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if port is not None:
        check_port(port)
    check_elastic(spec, workers)
    for warning in preflight(spec, workers):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if on_checked is not None:
        on_checked()
    if spec.elastic:
        try:
            return run_sites(spec, workers)
        except SitesFailed as e:
            raise LaunchError(str(e), e.exitcode) from None
        except KeyboardInterrupt:
            raise Interrupted(interrupted_message(spec.out)) from None
    return _run_local(spec, workers, port)


def _own_site(spec: RunSpec, on_checked: Callable[[], None] | None) -> dict[str, Any] | None:
    """This process is site ``site`` of a run whose sites are each launched on their own: it
    starts with the others, or joins (heals) if the run is going; its own summary."""
    from .join_site import run_site
    from .site_role import ElasticSite

    global _site_launched
    cfg, m = spec.train, spec.membership
    _site_launched = m.site
    ranks = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
    if cfg.ranks_per_worker not in (1, ranks):
        raise ConfigError(
            f"ranks_per_worker={cfg.ranks_per_worker} but this site has {ranks} "
            f"rank{'s' if ranks > 1 else ''}: a site "
            f"launched on its own is its torchrun world (--nproc-per-node {cfg.ranks_per_worker}"
            f"), or drop ranks_per_worker"
        )
    if ranks > 1 and cfg.checkpoint_every:
        raise ConfigError(
            "checkpoint_every= with several ranks per site is not built (a site that comes "
            "back heals from the live sites instead): drop it, or give one rank per site"
        )
    if ranks > 1:  # the site's ranks are its torchrun world: FSDP2 (or DDP) inside it
        spec.train.ranks_per_worker = ranks
        spec.strategy.check(spec.sync, cfg, spec.resume)
    check_elastic(spec, m.sites)
    for warning in preflight(spec, m.sites):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if on_checked is not None:
        on_checked()
    if not os.environ.get("LOWCOMM_DEBUG"):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's client logs every quorum at INFO
    if int(os.environ.get("RANK", "0")) == 0:  # the site's first rank speaks for it
        print(
            f"lowcomm: site {m.site} of {m.sites} asks the lighthouse at {m.lighthouse} "
            f"whether the run is going (it starts with the others, or joins and heals)",
            flush=True,
        )
    # its folder holds its unfinished run: it only joins the run going (read before this
    # site writes anything; of a site's ranks, rank 0's reading is the one that asks)
    back = (spec.out / "metrics.jsonl").exists()
    spec = _with_run_id(spec, back)
    role = ElasticSite(m.site, m.sites, m.lighthouse, alone=True, back=back)
    if m.replay:
        role = _replayed_site(role, spec)
    return run_site(role, spec)


RUN_ID_FILE = "run_id"


def _with_run_id(spec: RunSpec, back: bool) -> RunSpec:
    """A site launched on its own: ``spec`` with its run's id: ``run_id=``; else, coming back
    into its folder's run, the one kept there; else one derived from the settings every site
    of the run shares (the same command on every machine gives the same id). Kept in its
    folder for its comebacks."""
    m, kept_file = spec.membership, spec.out / RUN_ID_FILE
    kept = kept_file.read_text().strip() if back and kept_file.exists() else ""
    if m.run_id and kept and m.run_id != kept:
        raise ConfigError(
            f"run_id={m.run_id}, but the unfinished run in {spec.out} is run {kept}: give "
            f"run_id={kept} to bring this site back into it, or a fresh --out"
        )
    run_id = m.run_id or kept or derived_run_id(spec)
    if int(os.environ.get("RANK", "0")) == 0 and run_id != kept:  # (its other ranks read it)
        spec.out.mkdir(parents=True, exist_ok=True)
        tmp = kept_file.with_suffix(".tmp")
        tmp.write_text(run_id + "\n")
        tmp.replace(kept_file)
    return spec.replace(membership=dataclasses.replace(m, run_id=run_id))


def derived_run_id(spec: RunSpec) -> str:
    """The run id of sites launched on their own without ``run_id=``: a hash of what every
    site of one run must share anyway (what the settings' fingerprint checks: the strategy,
    the sync settings but where a site keeps its state, the model, the rounds; and the sites)."""
    m, sync = spec.membership, dataclasses.asdict(spec.sync)
    sync.pop("state_device", None)
    shared = [spec.strategy.name, sync, spec.train.model, m.sites, m.rounds, m.late, m.weighting]
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode())
    return f"run-{digest.hexdigest()[:12]}"


def _replayed_site(role: ElasticSite, spec: RunSpec) -> ElasticSite:
    """A site launched on its own re-enacting a recorded run (``--replay``, any site's
    membership.jsonl of it): it leaves where it left then, and its command run again into the
    same folder (which then holds its unfinished run) brings it back at the sync where it
    joined then. Whoever restarted it then (an operator, a scheduler) restarts it now."""
    cfg = spec.membership
    leaves, joins = replay_leaves(cfg.replay, cfg.sites), replay_joins(cfg.replay, cfg.sites)
    heal_at = tuple(joins.values())  # every site offers a heal where one joined
    # (each rank of a site decides alike: rank 0 alone asks, and a comeback never reaches its
    # recorded leave again; only rank 0 refuses or speaks)
    role = replace(
        role,
        leave_after=leaves.get(cfg.site, ""),
        heal_at=heal_at,
        join_at=joins.get(cfg.site, "") if role.back else "",
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return role
    if role.back:
        if cfg.site not in joins:
            raise ConfigError(
                f"--replay {cfg.replay}: site {cfg.site} did not come back in the recorded run, "
                f"but --out {spec.out} holds its unfinished run: give a fresh --out"
            )
        print(
            f"lowcomm: replay: site {cfg.site} comes back at {joins[cfg.site]}, as in "
            f"the recorded run",
            flush=True,
        )
    elif cfg.site in leaves:
        again = (
            f"; run this command again to bring it back at {joins[cfg.site]}"
            if (cfg.site in joins)
            else ""
        )
        print(
            f"lowcomm: replay: site {cfg.site} will leave after {leaves[cfg.site]} as in the "
            f"recorded run{again}",
            flush=True,
        )
    return role


def _under_torchrun(spec: RunSpec, on_checked: Callable[[], None] | None) -> dict[str, Any] | None:
    """This process is one rank of the world torchrun made: check, then train on it."""
    cfg = spec.train
    if spec.elastic:
        raise ConfigError(
            "elastic=true under torchrun is not supported yet: start the sites with "
            "lowcomm train --workers M elastic=true"
        )
    from .loop import run_worker
    from .sites import site_of

    world = int(os.environ["WORLD_SIZE"])
    site_of(int(os.environ.get("RANK", "0")), world, cfg.ranks_per_worker)  # N divides it
    preflight(spec, world // cfg.ranks_per_worker)
    if on_checked is not None:
        on_checked()
    return run_worker(spec)


def _run_local(spec: RunSpec, workers: int, port: int | None) -> dict[str, Any] | None:
    """Start ``workers`` local processes with torch's elastic launcher; rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not os.environ.get("LOWCOMM_DEBUG"):
        # we report a failed worker in one line ourselves; LOWCOMM_DEBUG=1 shows torch's logs
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    cfg, out_dir = spec.train, spec.out
    clear_stale(out_dir)
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers * cfg.ranks_per_worker,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port or free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        # spawned, the launcher's own children: torch ties each to it (a killed launcher takes
        # them along) and reports a worker killed by a signal as the failure. Forked from a
        # preloaded server instead (~2 s less per start on 2 cores), a worker's kill reached
        # the launcher after its peers' failed collectives, which were then named instead
        start_method="spawn",
    )
    try:
        results = elastic_launch(lc, _entry)(spec)
    except (KeyboardInterrupt, SignalException):
        raise Interrupted(interrupted_message(out_dir)) from None
    except ChildFailedError as e:
        raise _worker_failure(e, out_dir) from None
    return results.get(0)


def _worker_failure(e: Any, out_dir: Path) -> LaunchError:
    """One line naming the failed worker and why, with the resume hint."""
    rank, failure = _root_failure(e)
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", msg)
    if failure.exitcode == 2:
        return LaunchError(_user_errors(out_dir) or f"worker {rank} stopped on a user error", 2)
    if failure.exitcode == 130:
        return Interrupted(interrupted_message(out_dir))
    what = (
        f"was lost (killed by signal {-failure.exitcode})"
        if failure.exitcode < 0
        else f"failed (exit code {failure.exitcode})"
    )
    msg = failure_of(out_dir, rank) or msg  # torch's own says only where to read about @record
    return LaunchError(
        f"worker {rank} (pid {failure.pid}) {what}: {msg}; the other workers were "
        f"stopped. {_last_checkpoint_hint(out_dir)}"
    )


def _root_failure(e: Any) -> tuple[int, Any]:
    """The failure that caused the others: a worker killed by a signal (its peers then fail in
    their next collective, sometimes before the launcher notices the kill), else the first."""
    killed = sorted((r, f) for r, f in getattr(e, "failures", {}).items() if f.exitcode < 0)
    return killed[0] if killed else e.get_first_failure()


def interrupted_message(out_dir: str | Path) -> str:
    """'interrupted at step N; last checkpoint ...; resume with ...' for a stopped run."""
    from . import checkpoint as ckpt

    out = Path(out_dir)
    step = _last_logged_step(out)
    with contextlib.suppress(Exception):  # the message must never hide the interruption
        last = ckpt.latest_complete(out, checksums=False)
        if last is not None:
            step = max(step, ckpt.step_of(last))
            return (
                f"interrupted at step {step}; last checkpoint {last} "
                f"(step {ckpt.step_of(last)}); "
                f"resume with `lowcomm train --resume {out}`"
            )
    return (
        f"interrupted at step {step}; no checkpoint was written, so the run cannot be "
        f"resumed (set checkpoint_every=N to make runs resumable)"
    )


def _last_logged_step(out: Path) -> int:
    """The last step rank 0 logged in metrics.jsonl (0 if none)."""
    step = 0
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                step = max(step, int(json.loads(line).get("step", 0)))
    return step


# the site this process is a rank of, when launched on its own (site=N): see peer_lost_message
_site_launched: int | None = None

# what gloo and NCCL say when a collective's peer process is gone
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "timed out", "Timed out")


def peer_lost_message(e: BaseException, out_dir: str | Path | None) -> str | None:
    """Under torchrun, one line for a run stopped because another worker vanished (else None).

    The launcher of `lowcomm train --workers M` names the lost worker itself; under torchrun each
    surviving rank sees only its failed collective, raised as a backend error with a traceback.
    """
    text = str(e).strip()
    if not under_torchrun() or out_dir is None or not any(s in text for s in _PEER_GONE):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])  # gloo's source location
    first = first.split(". ")[0]  # its first sentence: the rest is advice about logs
    if _site_launched is not None:  # a rank of a site launched on its own: the site leaves
        return (
            f"site {_site_launched}, rank {os.environ['RANK']}: another rank of this site is "
            f"gone ({first[:120]}); the whole site leaves the run and the others go on: run "
            f"the same command again to bring it back (it heals from the live sites)"
        )
    return (
        f"rank {os.environ['RANK']}: a collective failed because another worker is gone "
        f"({first[:120]}); this run stopped. {_last_checkpoint_hint(out_dir)} "
        f"Under torchrun, restart every node with --resume."
    )


def _last_checkpoint_hint(out_dir: str | Path) -> str:
    from . import checkpoint as ckpt

    try:
        last = ckpt.latest_complete(Path(out_dir), checksums=False)
    except Exception:  # the hint must never hide the real failure
        last = None
    if last is None:
        return "No checkpoint was written (set checkpoint_every=N to make runs resumable)."
    return f"Last checkpoint: {last} (continue with `lowcomm train --resume {out_dir}`)."


def find_resume(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint of a run folder and its saved run config, or ConfigError."""
    import warnings

    from . import checkpoint as ckpt

    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"--resume {run}: no such run folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = ckpt.latest_complete(run)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if last is None:
        raise ConfigError(
            f"--resume {run}: no complete checkpoint in {run / 'checkpoints'} "
            f"(runs write them with checkpoint_every=N)"
        )
    meta = ckpt.read_meta(last)
    return last, meta
