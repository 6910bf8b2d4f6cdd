"""lowcomm: train one model on many workers over slow links, communicating far less than DDP.

Public API: the general engine (:class:`LowComm` + :class:`SyncConfig`), its presets, the
per-step DDP comm hooks, and the errors users catch (all derive from :class:`LowCommError`).
Attributes load lazily, so ``import lowcomm.schedule`` or ``lowcomm.config`` does not import
torch.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import Any

# Fresh large tensors (codec payloads) otherwise cost ~45 ms of page faults each on CPU; must be
# set before torch is imported, and worker processes inherit it.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .errors import (  # noqa: E402  (torch-free)
    CheckpointError,
    ConfigError,
    LowCommError,
    MembershipError,
    NonFiniteError,
    PayloadError,
    ReplicaMismatchError,
)

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "LowComm": "engine",
    "SyncStats": "engine",
    "Elastic": "elastic",
    "SyncConfig": "config",
    "TrainConfig": "config",
    "DiLoCo": "presets",
    "StreamingDiLoCo": "presets",
    "SparseLoCo": "presets",
    "CO2": "presets",
    "preset_config": "presets",
    "GradReduceState": "loco",
    "allreduce_hook": "loco",
    "LoCoState": "loco",
    "loco_hook": "loco",
    "load_model": "train.export",
    "RunSummary": "train.summary",
}

__all__ = [
    *_LAZY,
    "LowCommError",
    "ConfigError",
    "NonFiniteError",
    "ReplicaMismatchError",
    "PayloadError",
    "CheckpointError",
    "MembershipError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lowcomm' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
