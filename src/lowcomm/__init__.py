"""lowcomm: train one model on many workers over slow links, communicating far less than DDP.

Public API: the general engine (:class:`LowComm` + :class:`SyncConfig`), its presets, and the
per-step DDP comm hook.
"""

import os as _os

# Fresh large tensors (codec payloads) otherwise cost ~45 ms of page faults each on CPU; must be
# set before torch is imported, and worker processes inherit it.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .config import ConfigError, SyncConfig, TrainConfig
from .engine import LowComm, SyncStats
from .loco import GradReduceState, LoCoState, TorchHookState, allreduce_hook, loco_hook, torch_hook
from .presets import CO2, DiLoCo, SparseLoCo, StreamingDiLoCo, preset_config

__all__ = [
    "LowComm", "SyncConfig", "SyncStats", "TrainConfig", "ConfigError",
    "DiLoCo", "StreamingDiLoCo", "SparseLoCo", "CO2", "preset_config",
    "GradReduceState", "allreduce_hook", "LoCoState", "loco_hook", "TorchHookState", "torch_hook",
]
__version__ = "0.1.0"
