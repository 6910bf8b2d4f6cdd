"""lowcomm's lab: what measures, shapes and attacks the core, kept apart from it.

- :mod:`.cli`: the ``lowcomm compare``, ``report``, ``simulate`` and ``bench`` commands;
- :mod:`.bench`: the codec and sync benchmarks, the GPU workload, the campaigns of faults and
  attacks (and :mod:`.bench.compare`, :mod:`.bench.report`: strategies side by side);
- :mod:`.sim`: the compute-utilization simulator;
- :mod:`.netshape`: links shaped by the kernel, in network namespaces;
- :mod:`.faults`: the fault grammar, each site's harness, and the trainer's extension that acts
  them out (``--faults``, ``site_link=``);
- :mod:`.peers`: torchft's DiLoCo run by our trainer beside ours (``torchft-diloco``);
- :mod:`.ddp_hooks`: PyTorch's bf16 and PowerSGD DDP hooks under our meter;
- :mod:`.int4_authors`: the LoCo authors' 4-bit quantiser, beside ours.

It plugs into the core as any package may (:mod:`lowcomm.plugins`): :func:`register`, the
``lowcomm.plugins`` entry point of this install, adds its commands, strategies, codec, DDP hooks
and trainer extension to the core's registries. The core imports nothing of it;
``python -m lowcomm.lab CMD ...`` runs the command line with the lab from a source tree that is
not installed.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Add the lab to the core's registries (once per process; the core calls it)."""
    global _registered
    if _registered:
        return
    _registered = True
    from . import ddp_hooks, int4_authors  # noqa: F401  (int4-authors: a codec on import)
    from .cli import register as commands
    from .faults import extension  # noqa: F401  (registers the trainer's Lab extension)
    from .peers import strategies  # noqa: F401  (registers torchft-diloco, torchft-streaming)

    commands()
    ddp_hooks.register()
