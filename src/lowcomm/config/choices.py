"""The closed choices of the config: one ``Literal`` per multiple-choice knob (the Literal is the
list of choices), and the codec names, which the codec registry declares (torch-free)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from ..codecs.registry import codec_names

# The closed choices of SyncConfig: one list each (the Literal is the list).
FragmentPattern = Literal["strided", "sequential"]
# a codec's name: one of CODECS, checked at run time (checks.check_types); no Literal, as the
# registry is the one list and a new codec's file adds its name
Codec = str
Reduce = Literal["auto", "allreduce", "gather", "two-phase"]
# a combine rule's name, or auto: one of AGGREGATIONS, checked at run time (checks.check_types)
Aggregation = str
Compensation = Literal["none", "ef", "loco"]
OuterKind = Literal["nesterov", "sgd", "co2"]
ClipMode = Literal["element", "norm"]
Merge = Literal["alpha", "continue"]
CO2Merge = Literal["continue", "reset"]
Buffers = Literal["average", "broadcast", "local"]
StateDevice = Literal["cpu", "model"]
#: which implementations the codecs' kernels run (lowcomm.codecs.kernels.MODES)
Kernels = Literal["auto", "torch"]
LocoQuantizer = Literal["ours", "authors"]
Shard = Literal["striped", "contiguous"]
DdpHook = Literal["allreduce", "bf16", "powersgd"]
LogTo = Literal["none", "tensorboard"]
InnerParallel = Literal["fsdp", "ddp"]
Rounds = Literal["lockstep", "quorum"]
Late = Literal["carry", "drop"]
Weighting = Literal["steps", "plain", "normalized"]

# the codec names by the properties their @register declares
CODECS: tuple[str, ...] = codec_names(core=True)
DENSE_CODECS: tuple[str, ...] = codec_names(core=True, dense=True)
ELEMENTWISE_CODECS: tuple[str, ...] = codec_names(core=True, elementwise=True)
SPARSE_CODECS: tuple[str, ...] = codec_names(core=True, sparse=True)


def _rule_names() -> tuple[str, ...]:
    """The combine rules' names: one file each in lowcomm/aggregate/rules/, named after it
    (``_`` read as ``-``; the rule class checks it carries its file's name). Read from the
    folder, not imported: the rules import torch and the config must not."""
    folder = Path(__file__).resolve().parent.parent / "aggregate" / "rules"
    files = (p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    return tuple(sorted(stem.replace("_", "-") for stem in files))


AGGREGATIONS: tuple[str, ...] = ("auto", *_rule_names())
# the rules not defined on top-k payloads (their ``dense_only``: tests/test_robust.py keeps the
# two alike), refused for codec=topk before any worker starts
DENSE_ONLY_RULES: tuple[str, ...] = ("centered-clip", "median", "trimmed-mean")
# the rules that are sums (``sum_decomposable``, kept alike by the same test): the only ones
# all-reduce and two-phase can run; reduce=auto picks gather for the others
SUM_RULES: tuple[str, ...] = ("mean",)
