"""Hugging Face's ``Trainer`` with a lowcomm engine: :class:`LowCommTrainer` and
:class:`LowCommCallback`.

``Trainer`` hands the model to Accelerate (``Trainer._prepare_for_training`` calls
``accelerator.prepare(model, optimizer)``), and ``Accelerator.prepare_model`` wraps it in
``DistributedDataParallel`` whenever more than one process is running (``not evaluation_mode and
self.multi_device``). That happens before any callback runs, so a callback alone would all-reduce
gradients every step: DiLoCo silently turned into DDP. :class:`LowCommTrainer` therefore replaces
its accelerator's ``prepare_model`` by one that always passes ``evaluation_mode=True``: device
placement and mixed precision still apply, the DDP wrap does not. Everything else of Accelerate's
multi-process mode stays on: each worker's data loader yields its own shard, metrics are
gathered, only the main process saves. The trainer wraps the optimizer it creates in the lowcomm
engine (which hooks ``optimizer.step()``), starts the engine at train begin and finishes it at
train end, so the model then holds the global parameters.

Checkpoints. Each Trainer checkpoint also gets every rank's engine state (:mod:`.resume`), and
``train(resume_from_checkpoint=...)`` loads it before the first step, so the resumed run trains
on exactly as the uninterrupted one. :class:`LowCommTrainer` writes the global parameters as the
checkpoint's model (what ``evaluate()`` sees and ``load_best_model_at_end`` loads); the engine
file holds each rank's local weights beside them.

:class:`LowCommCallback` does the engine part for a Trainer of your own that keeps data
parallelism off; at the first step it stops a run whose gradients are identical on every worker
(all-reduced: DDP). See docs/hf.md.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..config import split_sync_kwargs
from ..errors import ConfigError
from ..transport import Transport
from .resume import RunIdentity, load_state, save_state

if TYPE_CHECKING:  # the engine is imported when one is made (lowcomm.hf stays light)
    from ..engine import LowComm

Resume = Literal["exact", "model"]
RESUMES = ("exact", "model")


def make_engine(
    model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "diloco", **kwargs: Any
) -> LowComm:
    """The lowcomm engine of a named strategy (diloco, streaming, sparseloco, co2) on ``model``.

    ``kwargs`` are SyncConfig knobs (``sync_every=50``) or LowComm options (``timeout_s``).
    """
    from .. import strategies
    from ..engine import LowComm

    method = strategies.get(strategy)
    if method.per_step:
        raise ConfigError(
            f"strategy '{strategy}' is per-step gradient reduction: with the HF "
            f"Trainer use plain DDP (transformers.Trainer) instead of lowcomm"
        )
    sync_kw, other = split_sync_kwargs(kwargs)
    return LowComm(model, optimizer, method.config(**sync_kw), **other)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's AcceleratedOptimizer (whose step() calls it)."""
    return getattr(optimizer, "optimizer", optimizer)


def _grads_identical_everywhere(model: nn.Module) -> bool:
    """True when every worker holds bit-identical gradients: only an all-reduce makes them so."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    grads = [p.grad.detach().double() for p in model.parameters() if p.grad is not None]
    probe = torch.zeros(2, dtype=torch.float64)
    for g in grads:
        probe[0] += g.sum().cpu()
        probe[1] += g.pow(2).sum().cpu()
    everyone = Transport().all_gather(probe, control=True)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def checkpoint_folder(args: Any, state: Any) -> Path:
    """The folder the Trainer writes its checkpoint of step ``state.global_step`` to."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


class LowCommCallback(TrainerCallback):
    """Runs a lowcomm engine around an HF Trainer's training: started at train begin (it hooks
    the optimizer's ``step()``), its state written into every checkpoint, finished at train end
    (the model then holds the global parameters).

    Use it only in a Trainer that keeps data parallelism off (as :class:`LowCommTrainer` does): at
    the first optimizer step it checks, with one tiny all-gather, that the workers' gradients
    differ, and stops the run with a ``ConfigError`` if they are identical (a DDP wrap).

    ``resume``: what a Trainer resumed from a checkpoint does with the engine. ``"exact"`` loads
    the checkpoint's engine state and refuses, in one line, one that lacks it or was written
    with another strategy, world size or engine setting; ``"model"`` starts the outer loop
    afresh from the checkpoint's saved model. A resumed run's checkpoint is found as the
    Trainer names it (``output_dir/checkpoint-N``) unless ``resume_from`` says where it is.
    """

    def __init__(self, strategy: str = "diloco", resume: Resume = "exact", **kwargs: Any) -> None:
        if resume not in RESUMES:
            raise ConfigError(f"resume={resume!r}: use one of {', '.join(RESUMES)}")
        self.strategy = strategy
        self.resume: Resume = resume
        self.resume_from: str | Path | None = None
        # the folder of the checkpoint being saved, where the Trainer says (else the one it
        # writes outside hyperparameter search: output_dir/checkpoint-N)
        self.save_to: Path | None = None
        self.kwargs = kwargs
        self.engine: LowComm | None = None
        self.active = False
        self._checked = False

    # how this callback's user asks for a fresh outer loop, for the error lines
    fresh_option = "resume='model' to LowCommCallback"
    # whether its Trainer finishes the engine before loading the best model (LowCommTrainer)
    finishes_before_best_model = False

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Build the engine on the Trainer's model and optimizer, load a resumed checkpoint's
        engine state, and start it."""
        if model is None or optimizer is None:
            raise ConfigError(
                "LowCommCallback needs the Trainer's model and optimizer: add it "
                "to a transformers.Trainer (or use lowcomm.hf.LowCommTrainer)"
            )
        if _is_ddp(model):
            raise ConfigError(
                "the model is wrapped in DistributedDataParallel, which all-reduces "
                "gradients every step: use lowcomm.hf.LowCommTrainer"
            )
        if args.load_best_model_at_end and not self.finishes_before_best_model:
            # the Trainer loads the best checkpoint before any callback's on_train_end, so
            # finishing the engine there would overwrite it with a consolidation of its weights
            raise ConfigError(
                "LowCommCallback cannot follow load_best_model_at_end=True: the Trainer loads "
                "the best model before callbacks finish the outer loop; use "
                "lowcomm.hf.LowCommTrainer (or a subclass of it)"
            )
        inner = _unwrap_optimizer(optimizer)
        # a fresh engine per train() call: the optimizer may be a new one
        engine = make_engine(model, inner, self.strategy, **self.kwargs)
        resumed_from, self.resume_from = self.resume_from, None
        if state.global_step > 0 and self.resume == "exact":  # the Trainer resumed
            where = Path(resumed_from) if resumed_from else checkpoint_folder(args, state)
            ident = self._identity(args, engine)
            saved = load_state(
                where, args.process_index, ident, state.global_step, self.fresh_option
            )
            engine.load_state_dict(saved["engine"])  # applied as it starts
            inner.load_state_dict(saved["optimizer"])  # the Trainer loaded rank 0's everywhere
        if args.save_only_model:
            warnings.warn(
                f"save_only_model=True: checkpoints hold the model only, not the lowcomm "
                f"engine's state, so they cannot resume the outer loop exactly (only afresh, "
                f"with {self.fresh_option})",
                stacklevel=2,
            )
        self.engine = engine
        engine.start()
        self.active, self._checked = True, False

    def _identity(self, args: Any, engine: LowComm) -> RunIdentity:
        return RunIdentity.of(self.strategy, args.world_size, engine.config)

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        """Once per run: refuse gradients that were all-reduced (DiLoCo silently become DDP)."""
        if self._checked or model is None:
            return
        self._checked = True
        if _grads_identical_everywhere(model):
            raise ConfigError(
                "gradients are identical on every worker after the first step: the "
                "Trainer all-reduces them (DDP) or every worker reads the same data; "
                "use lowcomm.hf.LowCommTrainer, which keeps DDP off and shards data"
            )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's engine and inner optimizer state beside the Trainer's checkpoint,
        then wait for every rank's: a checkpoint is whole before anyone trains on."""
        engine, folder, self.save_to = self.engine, self.save_to, None
        if engine is None or not self.active or args.save_only_model:
            return
        save_state(
            folder or checkpoint_folder(args, state),
            args.process_index,
            self._identity(args, engine),
            state.global_step,
            engine.state_dict(),
            engine.inner_optimizer.state_dict(),
        )
        transport = engine.transport
        transport.blocking(transport.barrier)  # on the engine's own group, behind its syncs

    def finish(self) -> None:
        """Apply what is in flight and load the global parameters into the model (once)."""
        if self.engine is not None and self.active:
            self.engine.finish()
        self.active = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Finish the engine: the model then holds the global parameters."""
        self.finish()


class _TrainerCallback(LowCommCallback):
    """The callback as :class:`LowCommTrainer` drives it."""

    fresh_option = "lowcomm_resume='model' to LowCommTrainer"
    finishes_before_best_model = True


def _prepare_model_without_ddp(prepare_model: Any) -> Any:
    """Accelerator.prepare_model with DDP (and FSDP/TP) wrapping skipped: evaluation_mode=True
    keeps device placement, mixed precision and torch.compile."""

    def prepare(
        model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    return prepare


class LowCommTrainer(Trainer):
    """``transformers.Trainer`` for low-communication training: no DDP, one lowcomm engine.

    ``LowCommTrainer(model, args, train_dataset=..., lowcomm_strategy="diloco",
    lowcomm_kwargs={"sync_every": 50})``; ``lowcomm_kwargs`` are SyncConfig knobs. Each worker
    trains on its own shard of the data (Accelerate's sharded loaders) and the workers exchange
    only the engine's outer syncs. ``evaluate()`` during training uses the global parameters, and
    so do the checkpoints' model files; each checkpoint also holds every rank's engine state, so
    ``train(resume_from_checkpoint=True)`` continues the run exactly. ``lowcomm_resume="model"``
    instead starts the outer loop afresh from a checkpoint's model (see
    :class:`LowCommCallback`).
    """

    def __init__(
        self,
        *args: Any,
        lowcomm_strategy: str = "diloco",
        lowcomm_kwargs: dict[str, Any] | None = None,
        lowcomm_resume: Resume = "exact",
        **kwargs: Any,
    ) -> None:
        if lowcomm_resume not in RESUMES:
            raise ConfigError(f"lowcomm_resume={lowcomm_resume!r}: use one of {', '.join(RESUMES)}")
        self.lowcomm_callback = _TrainerCallback(
            lowcomm_strategy, resume=lowcomm_resume, **(lowcomm_kwargs or {})
        )
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ConfigError(
                "LowCommTrainer trains a full model replica per worker: turn off "
                "FSDP / DeepSpeed (fsdp=, deepspeed= in TrainingArguments)"
            )
        if self.args.fp16:
            # the engine counts optimizer steps; a step skipped on one worker shifts its syncs
            raise ConfigError(
                "fp16 loss scaling skips optimizer steps on overflow, worker by "
                "worker, which desynchronizes the syncs: use bf16=True instead"
            )
        self.add_callback(self.lowcomm_callback)
        # Scaling each loss by the token count of all workers assumes DDP averages gradients.
        if getattr(self.args, "average_tokens_across_devices", False):
            self.args.average_tokens_across_devices = False

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, with its model preparation never wrapping in DDP."""
        super().create_accelerator_and_postprocess()
        self.accelerator.prepare_model = _prepare_model_without_ddp(self.accelerator.prepare_model)

    @property
    def lowcomm(self) -> LowComm | None:
        """The engine of the current (or last) training run, or None before the first."""
        return self.lowcomm_callback.engine

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; a resumed run's checkpoint (a path, or ``True``: the last one in
        ``output_dir``, as the Trainer finds it) also gives the engine its state back."""
        where = resume_from_checkpoint
        if where is True:
            where = get_last_checkpoint(self.args.output_dir)  # None: the Trainer says so
        self.lowcomm_callback.resume_from = where or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint with the global parameters as its model (the engine's
        callback then writes each rank's own state beside it)."""
        cb = self.lowcomm_callback
        ctx = cb.engine.global_parameters() if cb.active else contextlib.nullcontext()
        with ctx:
            super()._save_checkpoint(model, trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        cb.save_to = Path(self._get_output_dir(trial=trial)) / folder

    def _load_best_model(self) -> None:
        """Finish the outer loop first (it publishes the run's last global model), then load
        the best checkpoint's global parameters as the Trainer does."""
        self.lowcomm_callback.finish()
        super()._load_best_model()

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer.evaluate on the global parameters while training, as each worker's differ."""
        cb = self.lowcomm_callback
        ctx = cb.engine.global_parameters() if cb.active else contextlib.nullcontext()
        with ctx:
            return super().evaluate(*args, **kwargs)
