"""Per-step gradient reduction (DDP hooks, FSDP2 reduce-scatter): the public names, re-exported.

The code lives in :mod:`lowcomm.hooks` (``ddp``: FP32 and PyTorch's hooks; ``loco_ddp``: LoCo's
DDP hook; ``loco_fsdp``: LoCo's FSDP2 reduce-scatter; ``patches``: the metering monkeypatch).
"""

from .hooks.ddp import TORCH_HOOKS, GradReduceState, TorchHookState, allreduce_hook, torch_hook
from .hooks.loco_common import DEFAULT_QUANTIZER, QUANTIZERS
from .hooks.loco_ddp import LoCoState, loco_hook
from .hooks.loco_fsdp import LoCoReduceScatter, enable_fsdp_loco

__all__ = [
    "DEFAULT_QUANTIZER",
    "QUANTIZERS",
    "TORCH_HOOKS",
    "GradReduceState",
    "LoCoReduceScatter",
    "LoCoState",
    "TorchHookState",
    "allreduce_hook",
    "enable_fsdp_loco",
    "loco_hook",
    "torch_hook",
]
