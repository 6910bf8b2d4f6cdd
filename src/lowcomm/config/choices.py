"""The closed choices of the config: one ``Literal`` per multiple-choice knob (the Literal is the
list of choices), and the codec names."""

from __future__ import annotations

from typing import Literal, get_args

# The closed choices of SyncConfig: one list each (the Literal is the list).
FragmentPattern = Literal["strided", "sequential"]
Codec = Literal[
    "fp32", "bf16", "fp16", "int8", "int4", "int2", "fp4", "topk", "loco", "int4-authors"
]
Reduce = Literal["auto", "allreduce", "gather", "two-phase"]
# auto + the combine rules' names: the rules (aggregate/rules/) register themselves, but they
# import torch and this module must not, so the list is kept here; tests/test_combine.py checks it
Aggregation = Literal["auto", "mean", "selected-mean"]
Compensation = Literal["none", "ef", "loco"]
OuterKind = Literal["nesterov", "sgd", "co2"]
ClipMode = Literal["element", "norm"]
Merge = Literal["alpha", "continue"]
CO2Merge = Literal["continue", "reset"]
Buffers = Literal["average", "broadcast", "local"]
StateDevice = Literal["cpu", "model"]
LocoQuantizer = Literal["ours", "authors"]
Shard = Literal["striped", "contiguous"]
DdpHook = Literal["allreduce", "bf16", "powersgd"]
LogTo = Literal["none", "tensorboard"]
InnerParallel = Literal["fsdp", "ddp"]
Rounds = Literal["lockstep", "quorum"]
Late = Literal["carry", "drop"]

CODECS: tuple[str, ...] = get_args(Codec)
DENSE_CODECS = ("fp32", "bf16", "fp16")
