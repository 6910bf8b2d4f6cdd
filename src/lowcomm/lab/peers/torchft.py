"""The `torchft-diloco` and `torchft-streaming` compare entries: torchft run by our trainer.

torchft (PyPI ``torchft-nightly``, an optional extra) is fault-tolerant training from the PyTorch
team; its ``DiLoCo`` (which is also its Streaming DiLoCo, given several model fragments) is the
implementation users most often compare us with. This module runs it inside
:func:`lowcomm.train.loop.run_worker` with the same model, data, inner optimizer, H, outer
optimizer and (shaped) network as our own DiLoCo or Streaming DiLoCo, so they are measured side
by side. ``torchft-streaming`` gets our fragments (the same parameters in each), torchft's
overlap ``fragment_sync_delay`` = our ``overlap`` and its ``fragment_update_alpha`` = our
``alpha``; it sends FP32 (torchft's low-bit path needs CUDA and Triton).

Schedules: torchft syncs one fragment every H/P steps, fragment i first after (i+1)·H/P steps,
sending it ``overlap`` steps before that; ours sends fragment p after p·H/P steps (+ k·H) and
applies it ``overlap`` steps later. With overlap 0 the two coincide once torchft's fragment list
is ours rotated by one (its first fragment is our second); with overlap > 0 torchft's sends come
``overlap`` steps earlier in the round than ours, the same rule at another phase.

Each of our workers is one torchft replica group of size 1: it owns a TCPStore and a Manager;
rank 0 also runs the lighthouse (torchft's quorum server) in-process. torchft's traffic goes
through its own gloo process group, which we meter by wrapping ``Manager.allreduce`` (ring
all-reduce wire cost, as for every other strategy) and time by wrapping DiLoCo's optimizer hook:
the quorum, the wait for the all-reduce and the outer step all count as blocked time.

:class:`TorchftDiLoCo` offers the part of :class:`~lowcomm.engine.LowComm` the trainer uses
(context manager, ``global_parameters``, ``transport.meter``, ``stats``, ``finish``) so the
training loop stays one loop. Checkpoints and resume are not supported for this peer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

from lowcomm.config import ConfigError, SyncConfig
from lowcomm.elastic import Elastic
from lowcomm.engine import SyncStats
from lowcomm.transport import ByteMeter, Transport, ring_all_reduce_bytes


def _import_torchft() -> Any:
    if not os.environ.get("LOWCOMM_DEBUG"):
        # torchft's Rust side logs every quorum at INFO; keep run logs readable
        # (LOWCOMM_DEBUG=1 shows them)
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.WARNING)
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        raise ConfigError(
            f"the torchft entries need torchft: pip install 'lowcomm[torchft]' "
            f"(or pip install torchft-nightly==2026.10.26) ({e})"
        ) from None
    return SimpleNamespace(
        LighthouseServer=LighthouseServer,
        DiLoCo=DiLoCo,
        Manager=Manager,
        ProcessGroupGloo=ProcessGroupGloo,
    )


def check_config(sync_cfg: SyncConfig, checkpoint_every: int, resume: str | None) -> None:
    """Reject what this peer cannot do (or a missing torchft), before any worker starts."""
    _import_torchft()
    if sync_cfg.outer_optimizer != "nesterov":
        raise ConfigError(
            "torchft's DiLoCo runs a Nesterov SGD outer optimizer; "
            f"outer_optimizer={sync_cfg.outer_optimizer!r} is not supported"
        )
    if sync_cfg.codec not in ("none", "fp32"):
        raise ConfigError(
            f"torchft's DiLoCo sends FP32 on CPU; codec={sync_cfg.codec!r} is not supported"
        )
    if checkpoint_every or resume:
        raise ConfigError(
            "the torchft entries are benchmark peers: checkpoints and resume are not supported "
            "(set checkpoint_every=0)"
        )
    if sync_cfg.merge != "alpha" or sync_cfg.reduce not in ("auto", "allreduce"):
        raise ConfigError(
            "torchft's DiLoCo all-reduces FP32 and merges by alpha: "
            f"merge={sync_cfg.merge!r}, reduce={sync_cfg.reduce!r} are not supported"
        )


def check_fragments(model: nn.Module, sync_cfg: SyncConfig) -> None:
    """ConfigError if torchft's Streaming DiLoCo cannot run our fragments of ``model`` (meta
    tensors do: only names and shapes are read)."""
    _torchft_fragments(model, sync_cfg)


def _torchft_fragments(model: nn.Module, sync_cfg: SyncConfig) -> list[nn.Module]:
    """Our fragments as the modules torchft's DiLoCo takes, in the order it syncs them."""
    from lowcomm.schedule import build_fragments, find_blocks

    params = dict(model.named_parameters())
    names = [n for n, p in params.items() if p.requires_grad]
    ours = build_fragments(
        names,
        find_blocks(model),
        sync_cfg.fragments,
        sync_cfg.blocks_per_fragment,
        sync_cfg.fragment_pattern,
    )
    H, P, tau = sync_cfg.sync_every, len(ours), sync_cfg.tau
    if H % P or tau >= H // P:
        raise ConfigError(
            f"torchft's Streaming DiLoCo needs sync_every divisible by the {P} fragments and "
            f"overlap < sync_every/fragments: sync_every={H}, overlap={tau} do not fit"
        )
    return [_Shared([(n, params[n]) for n in ours[(i + 1) % P]]) for i in range(P)]


class _Shared(nn.Module):
    """Some of a model's parameters as a module of their own (the same tensors, not copies)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def _own_address() -> str:
    """The address peers reach this worker at: ours in a shaped namespace, else loopback."""
    return os.environ.get("LOWCOMM_ADDR") or os.environ.get("MASTER_ADDR", "127.0.0.1")


class TorchftDiLoCo:
    """torchft's DiLoCo behind the slice of the LowComm interface that the trainer uses.

    ``streaming=True`` hands it our fragments (torchft's Streaming DiLoCo); else the whole model.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_cfg: SyncConfig,
        timeout_s: float = 300.0,
        streaming: bool = False,
        elastic: Elastic | None = None,
        peer_lighthouse: str = "",
    ) -> None:
        ft = _import_torchft()
        self.model = model
        self.opt = inner_optimizer
        if elastic is None:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:  # a site of an elastic run: a process of its own, torchft's lighthouse given
            self.rank, self.world = elastic.site, elastic.sites
        meter = ByteMeter()
        self.transport = SimpleNamespace(meter=meter, blocking=lambda fn: fn())
        self.stats = SyncStats()
        self.outer = None  # torchft runs its own outer step: no clipping or penalty counters
        self.last_sync_step = -1
        self._step = 0
        timeout = timedelta(seconds=timeout_s)

        # the lighthouse runs in rank 0's process; everyone learns its address over the
        # control group
        self._lighthouse = None
        addr: list[str | None] = [peer_lighthouse]
        if elastic is None:
            if self.rank == 0:
                self._lighthouse = ft.LighthouseServer(bind="0.0.0.0:0", min_replicas=self.world)
                port = urlparse(self._lighthouse.address()).port
                addr = [f"http://{_own_address()}:{port}"]
            addr = [Transport().broadcast_object(addr[0], src=0)]
        host = _own_address()
        if os.environ.get("LOWCOMM_ADDR"):
            # torchft advertises socket.gethostname() for its process group's store; inside a
            # per-worker namespace that name resolves to the namespace's own loopback, which the
            # peers cannot reach. This process is one worker, so point the name at our address.
            socket.gethostname = lambda: host  # type: ignore[assignment]
        # a replica group of one: its own store, on the address its peers can reach
        self._store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        self.manager = ft.Manager(
            pg=ft.ProcessGroupGloo(timeout=timeout),
            # an elastic run goes on while min_workers replicas remain
            min_replica_size=elastic.min_workers if elastic else self.world,
            load_state_dict=self._load_state,
            state_dict=self._state,
            # every rank builds the same seeded model, so no step-0 healing (with init_sync,
            # torchft's first quorum, after H local steps, would overwrite replica 1's first
            # round with replica 0's)
            init_sync=False,
            use_async_quorum=False,
            replica_id=f"lowcomm_{self.rank}",
            store_addr=host,
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=addr[0],
            hostname=host,
            port=0,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        self._meter_allreduce()
        self.diloco = self._make_diloco(ft, sync_cfg, streaming)
        self._time_hook()
        self.membership: PeerMembership | None = None
        if elastic is not None:
            step = lambda: self._step  # noqa: E731 (the inner step when a sync commits)
            every = self.diloco._sync_every  # one round's inner steps (torchft-diloco: P = 1)
            self.membership = PeerMembership(elastic, self.manager, meter, step, every)

    def _make_diloco(self, ft: Any, sync_cfg: SyncConfig, streaming: bool) -> Any:
        """torchft's DiLoCo over our fragments (streaming) or the whole model."""
        model = self.model
        fragments = _torchft_fragments(model, sync_cfg) if streaming else [model]
        # one outer optimizer per fragment, as torchft's own streaming tests do: a shared one
        # would also step the other fragments' parameters by the inner gradients still on them
        outer = [
            torch.optim.SGD(
                f.parameters(),
                lr=sync_cfg.outer_lr,
                momentum=sync_cfg.outer_momentum,
                nesterov=sync_cfg.outer_momentum > 0,
            )
            for f in fragments
        ]
        tau = sync_cfg.tau if streaming else 0
        return ft.DiLoCo(
            self.manager,
            fragments,
            self.opt,
            outer,
            sync_every=sync_cfg.sync_every,
            backup_device=next(model.parameters()).device,
            fragment_sync_delay=tau,
            # ours mixes only when a result arrives late (tau > 0), as the paper does
            fragment_update_alpha=sync_cfg.alpha if tau > 0 else 0.0,
        )

    # -- state for torchft's healing of a replica that joins late (not used when all start together)
    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner_optim": self.opt.state_dict()}

    def _load_state(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["inner_optim"])

    def _meter_allreduce(self) -> None:
        """Count each all-reduce torchft issues at the ring cost 2(M-1)/M of its bytes."""
        orig = self.manager.allreduce
        meter = self.transport.meter

        def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            n = tensor.numel() * tensor.element_size()
            wire = ring_all_reduce_bytes(n, max(self.manager.num_participants(), 1))
            meter.record(n, wire, wire, control=False)
            self.stats.payload_bytes += n
            self.stats.bytes_sent += int(wire)
            return orig(tensor, *args, **kwargs)

        self.manager.allreduce = allreduce

    def _time_hook(self) -> None:
        """Time DiLoCo's optimizer post-hook: on a send step it is the quorum and the start of
        the all-reduce; on an apply step the wait for it and the outer step (the same step when
        nothing overlaps)."""
        orig = self.diloco._step_post_hook
        meter = self.transport.meter
        every = self.diloco._sync_every  # steps between two fragment syncs (H / P)
        send_at = every - self.diloco._fragment_sync_delay

        def hook(*args: Any, **kwargs: Any) -> None:
            self._step += 1
            due = self.diloco._local_step + 1
            before = self.stats.bytes_sent
            t0 = time.perf_counter()
            orig(*args, **kwargs)
            if due in (send_at, every):
                meter.add_blocked(time.perf_counter() - t0)
            self.stats.peak_bytes_per_sync = max(
                self.stats.peak_bytes_per_sync, self.stats.bytes_sent - before
            )
            if due == every:  # a fragment's outer step was applied
                self.stats.syncs += 1
                self.last_sync_step = self._step

        self.diloco._step_post_hook = hook  # registered by DiLoCo.__enter__, so patch before it

    @property
    def step(self) -> int:
        """Inner steps so far (names the trainer's control collectives)."""
        return self._step

    def __enter__(self) -> TorchftDiLoCo:
        if self.membership is not None:
            self.membership.start()
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.diloco.__exit__(*exc)
        # every replica leaves its last quorum before rank 0 takes the lighthouse down
        Transport().barrier()
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
        if self.membership is not None:
            self.membership.close()

    @contextlib.contextmanager
    def global_parameters(self) -> Iterator[None]:
        """Swap in torchft's global copy (its backup of the last synced parameters, per
        fragment) for evaluation."""
        pairs = [
            (p, frag.original_parameters[n])
            for frag in self.diloco._fragments
            for n, p in frag._model_fragment.named_parameters()
        ]
        local = [p.detach().clone() for p, _ in pairs]
        with torch.no_grad():
            for p, g in pairs:
                p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _), saved in zip(pairs, local):
                    p.copy_(saved)

    def finish(self) -> None:
        """Wait for an all-reduce still in flight (a fragment sent within ``overlap`` steps of
        the end; torchft never applies it, and neither do we)."""
        for frag in self.diloco._fragments:
            for work in frag._allreduce_work:
                work.wait()
        self.stats.inner_steps = self._step
        self.stats.blocked_s = self.transport.meter.blocked_s


class PeerMembership:
    """An elastic run of torchft's DiLoCo, seen as the trainer sees lowcomm's membership.

    torchft's Manager decides who is in each of its syncs, on a lighthouse of its own (given by
    the launcher); lowcomm's membership carries only the trainer's control collectives (loss
    logging, evaluation, the summary). ``events`` records torchft's syncs whose members changed,
    read from its quorums and commits: who left, the survivors' time to sync again, and the
    inner steps torchft threw away (a failed commit restores every replica's last global copy).
    """

    def __init__(
        self,
        elastic: Elastic,
        manager: Any,
        meter: ByteMeter,
        step: Callable[[], int],
        every: int,
    ) -> None:
        from lowcomm.elastic import Membership, Runner

        self._control = Runner(Membership(elastic), meter, meter)
        self.events: list[dict] = []
        self._step, self._every = step, every
        self._members: list[int] | None = None  # torchft's members at the last commit
        self._last = ("start", 0)  # that commit's sync tag and inner step
        self._quorum: list[int] = []  # the members of torchft's latest quorum
        self._asked: float | None = None  # when this sync first asked for a quorum
        self._discarded = 0  # inner steps thrown away by failed commits since the last one
        manager._client = _QuorumSpy(manager._client, self._on_quorum)
        commit = manager.should_commit

        def should_commit(*args: Any, **kwargs: Any) -> bool:
            ok = commit(*args, **kwargs)
            self._on_commit(ok)
            return ok

        manager.should_commit = should_commit

    @property
    def members(self) -> list[int] | None:
        """The sites of the last control collective (who writes, how evaluation is split)."""
        return self._control.members

    def start(self) -> None:
        """The first control quorum: every site learns who starts the run."""
        self._control.record.members = self._control.membership.start().members

    def run(self, tag: str, collectives: Callable[..., Any]) -> Any:
        """A control collective on the live sites (lowcomm's membership)."""
        return self._control.run(tag, collectives)

    def close(self) -> None:
        """Stop this site's heartbeats to lowcomm's lighthouse."""
        self._control.membership.close()

    def _on_quorum(self, asked: float, replica_ids: list[str]) -> None:
        if self._asked is None:
            self._asked = asked
        self._quorum = sorted(_site_of(r) for r in replica_ids)

    def _on_commit(self, ok: bool) -> None:
        if not ok:  # every replica restores its global copy: the round's steps are lost
            self._discarded += self._every
            return
        step = self._step()
        if self._members is not None and self._quorum != self._members:
            self.events.append(
                {
                    "at": f"sync@{step}",
                    "after": self._last[0],
                    "last_step": self._last[1],
                    "left": sorted(set(self._members) - set(self._quorum)),
                    "members": list(self._quorum),
                    "resync_s": round(time.perf_counter() - (self._asked or 0.0), 3),
                    "discarded_steps": self._discarded,
                }
            )
        self._members, self._last = list(self._quorum), (f"sync@{step}", step)
        self._asked, self._discarded = None, 0


class _QuorumSpy:
    """torchft's manager client, passing when each quorum was asked for and its replica ids
    to ``seen``."""

    def __init__(self, client: Any, seen: Callable[[float, list[str]], None]) -> None:
        self._client, self._seen = client, seen

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        asked = time.perf_counter()
        quorum = self._client._quorum(*args, **kwargs)
        self._seen(asked, list(quorum.replica_ids))
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _site_of(replica_id: str) -> int:
    """The site number in torchft's replica id (``lowcomm_<site>:<uuid>``)."""
    return int(replica_id.split(":")[0].rsplit("_", 1)[1])
