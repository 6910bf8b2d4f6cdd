"""Per-step gradient reduction (DDP hooks, FSDP2 reduce-scatter): the public names, re-exported.

The code lives in :mod:`lowcomm.hooks` (``ddp``: the FP32 hook and the registry of others;
``loco_ddp``: LoCo's DDP hook; ``loco_fsdp``: LoCo's FSDP2 reduce-scatter).
"""

from .hooks.ddp import GradReduceState, allreduce_hook
from .hooks.loco_common import DEFAULT_QUANTIZER, QUANTIZERS
from .hooks.loco_ddp import LoCoState, loco_hook
from .hooks.loco_fsdp import LoCoReduceScatter, enable_fsdp_loco

__all__ = [
    "DEFAULT_QUANTIZER",
    "QUANTIZERS",
    "GradReduceState",
    "LoCoReduceScatter",
    "LoCoState",
    "allreduce_hook",
    "enable_fsdp_loco",
    "loco_hook",
]
