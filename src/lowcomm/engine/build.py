"""Building an engine: the checks on a user's arguments (one line each, before anything is
built), the fragments resolved from the model, and their global copies from rank 0."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..aggregate import Aggregator
from ..config import ConfigError, SyncConfig, split_sync_kwargs
from ..outer import OuterOptimizer
from ..schedule import build_fragments as fragment_names
from ..schedule import check_fragments, expand_fragment_modules, find_blocks
from ..transport import Transport
from .fragment import Fragment
from .placement import Placement
from .state import RunState, StatePart
from .sync import Merge
from .tensors import buckets, local, views


def check_arguments(model: Any, opt: Any, config: Any, timeout_s: Any, overrides: dict) -> None:
    """One-line ConfigErrors for arguments of the wrong kind, before anything is built."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"inner_optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    if config is not None and not isinstance(config, SyncConfig):
        raise ConfigError(f"config must be a lowcomm.SyncConfig, got {type(config).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    sync, other = split_sync_kwargs(overrides)
    if other:
        raise ConfigError(
            f"unknown sync option(s) {', '.join(other)}: see lowcomm.SyncConfig for the knobs"
        )


def trainable_params(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, nn.Parameter]:
    """The model's trainable parameters by name; some must be held by the inner optimizer."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ConfigError("the model has no trainable parameters: unfreeze some (requires_grad)")
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    if not any(id(p) in held for p in params.values()):
        raise ConfigError(
            "the inner optimizer holds none of the model's trainable parameters: "
            "build it from this model's parameters (e.g. AdamW(model.parameters()))"
        )
    return params


def resolve_fragments(
    model: nn.Module, cfg: SyncConfig, modules: list[list[str]] | None
) -> list[list[str]]:
    """Parameter names per fragment: from ``fragment_modules`` if given, else the model's
    blocks split by the config; checked to cover every trainable parameter once."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if modules is not None:
        if not isinstance(modules, (list, tuple)) or not modules:
            raise ConfigError(
                "fragment_modules must be a non-empty list of lists of module "
                "or parameter names, e.g. [['embed', 'head'], ['layers.0']]"
            )
        fragments = expand_fragment_modules(list(modules), names)
    else:
        fragments = fragment_names(
            names, find_blocks(model), cfg.fragments, cfg.blocks_per_fragment, cfg.fragment_pattern
        )
    check_fragments(fragments, names)
    cfg.check_schedule(len(fragments))
    return fragments


def build_fragments(
    names: list[list[str]],
    by_name: dict[str, nn.Parameter],
    cfg: SyncConfig,
    placement: Placement,
    transport: Transport | None,
    merge: Merge,
) -> list[Fragment]:
    """Every fragment's global copy from rank 0's parameters, loaded into every worker
    (``transport`` None: a joining site's own, replaced by its heal)."""
    bucket_numel = max(1, int(cfg.bucket_mb * 2**20 / 4))
    state_device = _state_device(cfg, by_name)
    frags = []
    with torch.no_grad():
        for i, group in enumerate(names):
            params = [local(by_name[n], placement.part) for n in group]
            flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
            # every worker starts from rank 0's parameters (control traffic, not training)
            if transport is not None:
                transport.broadcast(flat, src=0, control=True)
            flat = flat.to(state_device)
            if state_device.type == "cpu" and params and params[0].is_cuda:
                flat = flat.pin_memory()  # host state of a GPU model: copies at full speed
            frag = Fragment(
                i,
                list(group),
                [by_name[n] for n in group],
                flat,
                views(flat, params),
                buckets(params, bucket_numel),
                part=placement.part,
                kernels=cfg.kernels,
            )
            if merge.needs_snapshot:
                # (a clone would not be pinned: host state copies at full speed both ways)
                frag.snapshot = torch.empty_like(flat, pin_memory=flat.is_pinned()).copy_(flat)
            frags.append(frag)
            frag.load_global()
        placement.share_parts(frags)
        if transport is not None:
            placement.broadcast_constants(transport, cfg.buffers, floating=True)
            # rank 0's broadcast returns once its bytes are queued; on a slow link a receiver
            # holds the model seconds later. Meet here, so that skew is not waited out (and
            # counted) at the first sync.
            transport.all_gather(torch.zeros(1), control=True)
    return frags


def _state_device(cfg: SyncConfig, by_name: dict[str, nn.Parameter]) -> torch.device:
    if cfg.state_device == "model":
        return next(iter(by_name.values())).device
    return torch.device(cfg.state_device)


def register_optimizer_state(
    state: RunState,
    outer: OuterOptimizer,
    compensation: Any,
    aggregator: Aggregator,
    transport: Transport,
) -> None:
    """Declare the state of the math parts, which know nothing of the run state: the outer
    optimizer (shared), the error compensation and the two-phase reduce's own (per site)."""
    state.register(
        "outer", StatePart(outer.state_dict, outer.load_state_dict, shared=True, buffer=True)
    )
    state.register(
        "compensation",
        StatePart(
            lambda: compensation.state_dict() if compensation is not None else {},
            lambda v: compensation.load_state_dict(v) if compensation is not None and v else None,
            fresh={},  # error buffers of a world that is gone: a fresh worker starts at zero
            buffer=True,
        ),
    )
    reduce_comp = aggregator.reduce_compensation

    def save_reduce() -> dict[str, Any]:
        if reduce_comp is None:
            return {}
        transport.wait(transport.submit(lambda: None))  # it updates on the comm thread
        return reduce_comp.state_dict()

    def load_reduce(saved: dict[str, Any] | None) -> None:
        if reduce_comp is not None and saved:
            reduce_comp.load_state_dict(saved)

    state.register(
        "reduce_compensation", StatePart(save_reduce, load_reduce, fresh={}, buffer=True)
    )
