"""Hugging Face ``transformers`` in lowcomm: causal LMs for the trainer, and HF's Trainer.

- :mod:`.models`: ``model=hf:ARCH[:PRESET]`` and ``model=hf:PATH`` as lowcomm models.
- :mod:`.trainer`: :class:`LowCommTrainer`, a ``transformers.Trainer`` that keeps data
  parallelism off and runs one lowcomm engine, and :class:`LowCommCallback`, the engine part
  alone for a Trainer of your own.
- :mod:`.resume`: the engine's state in each Trainer checkpoint, one file per rank, so
  ``trainer.train(resume_from_checkpoint=True)`` continues the outer loop exactly.

See docs/hf.md. Needs the extra: ``pip install 'lowcomm[hf]'``.
"""

from __future__ import annotations

try:  # an optional extra
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lowcomm.hf needs Hugging Face transformers: pip install 'lowcomm[hf]'"
    ) from err

from .models import HFCausalLM, HFShape, build_hf_model, hf_config, load_hf_model, parse_spec
from .trainer import LowCommCallback, LowCommTrainer, make_engine

__all__ = [
    "HFCausalLM",
    "HFShape",
    "hf_config",
    "parse_spec",
    "load_hf_model",
    "build_hf_model",
    "make_engine",
    "LowCommCallback",
    "LowCommTrainer",
]
