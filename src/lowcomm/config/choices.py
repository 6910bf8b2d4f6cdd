"""The closed choices of the config: one ``Literal`` per multiple-choice knob (the Literal is the
list of choices), and the codec names, which the codec registry declares (torch-free)."""

from __future__ import annotations

from typing import Literal

from ..codecs.registry import codec_names

# The closed choices of SyncConfig: one list each (the Literal is the list).
FragmentPattern = Literal["strided", "sequential"]
# a codec's name: one of CODECS, checked at run time (checks.check_types); no Literal, as the
# registry is the one list and a new codec's file adds its name
Codec = str
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

# the codec names by the properties their @register declares
CODECS: tuple[str, ...] = codec_names()
DENSE_CODECS: tuple[str, ...] = codec_names(dense=True)
ELEMENTWISE_CODECS: tuple[str, ...] = codec_names(elementwise=True)
SPARSE_CODECS: tuple[str, ...] = codec_names(sparse=True)
