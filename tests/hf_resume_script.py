"""A Hugging Face Trainer user's script, run by tests/test_hf.py under torchrun: GPT-2 from a
config (2 layers, width 48), a small in-memory dataset, ``LowCommTrainer``.

``torchrun --nproc-per-node 2 hf_resume_script.py OUT MODE:STRATEGY[,MODE:STRATEGY...]`` runs
the modes one after the other in the same processes (a torchrun start paid once) and writes
what each found under ``OUT/STRATEGY/MODE/``:

- ``full``: 40 steps uninterrupted, a checkpoint every 20 kept by ``save_total_limit=1``;
- ``stop``: the same run, slowed after its checkpoint at step 20 so that the test can SIGKILL
  every process from outside before step 40 (it never returns);
- ``resume``: ``train(resume_from_checkpoint=True)`` into ``stop``'s folder;
- ``refuse``: resumes that must be refused, each with its one line: ``stop``'s checkpoint with
  another engine setting, and ``saveonly``'s checkpoint;
- ``saveonly``: 20 steps with ``save_only_model=True`` (the warning it gives);
- ``best``: 30 steps, ``load_best_model_at_end=True`` (what the model holds at the end);
- ``own-full``, ``own-stop``, ``own-resume``: as ``full``, ``stop`` and ``resume`` with
  ``LowCommCallback`` in a Trainer of the user's own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from lowcomm.errors import LowCommError
from lowcomm.hf import LowCommCallback, LowCommTrainer
from lowcomm.hf.trainer import _prepare_model_without_ddp

SETTINGS = {
    "diloco": {"sync_every": 10},
    "streaming": {"sync_every": 10},
    "sparseloco": {"sync_every": 10, "density": 1 / 8},
    "co2": {"sync_every": 10},
}
RANK = int(os.environ.get("RANK", "0"))


def _data(rows: int = 400) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(rows):
        ids = torch.randint(0, 256, (32,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # dropout stays at GPT-2's 0.1: the RNG must be restored too
    cfg = GPT2Config(n_layer=2, n_embd=48, n_head=4, vocab_size=256, n_positions=32)
    return GPT2LMHeadModel(cfg)


class Slow(TrainerCallback):
    """After its checkpoint at step 20, a step takes seconds: the kill comes meanwhile."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 20:
            time.sleep(3.0)


class OwnTrainer(Trainer):
    """A user's Trainer that keeps data parallelism off on its own (LowCommCallback's case)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.prepare_model = _prepare_model_without_ddp(self.accelerator.prepare_model)


def _args(out: Path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        max_steps=40,
        save_steps=20,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        logging_steps=10,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **kw})


def _trainer(strategy: str, out: Path, callbacks=(), own: bool = False, **kw):
    args = _args(out, **{k: v for k, v in kw.items() if not k.startswith("lowcomm_")})
    if own:
        cb = LowCommCallback(strategy, **SETTINGS[strategy])
        model = _model()
        return OwnTrainer(model=model, args=args, train_dataset=_data(), callbacks=[*callbacks, cb])
    return LowCommTrainer(
        model=_model(),
        args=args,
        train_dataset=_data(),
        eval_dataset=_data(24) if kw.get("eval_strategy") else None,
        callbacks=list(callbacks),
        lowcomm_strategy=strategy,
        lowcomm_kwargs={**SETTINGS[strategy], **kw.get("lowcomm_kwargs", {})},
    )


def _final(trainer: Trainer, here: Path) -> None:
    torch.save(
        {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        here / f"final{RANK}.pt",
    )


def _refused(make) -> str | None:
    """The one line a resume is refused with (None: it was not)."""
    try:
        make().train(resume_from_checkpoint=True)
    except LowCommError as err:
        return str(err)
    return None


def run(root: Path, mode: str, strategy: str) -> None:
    """One mode of the module docstring, its results under ``root/strategy/mode``."""
    here = root / strategy / mode
    here.mkdir(parents=True, exist_ok=True)
    own = mode.startswith("own-")
    kind = mode.removeprefix("own-")
    part = root / strategy / ("own-part" if own else "part")
    if kind == "full":
        trainer = _trainer(strategy, here / "out", own=own, save_total_limit=1)
        trainer.train()
        _final(trainer, here)
    elif kind == "stop":
        _trainer(strategy, part, callbacks=[Slow()], own=own).train()
        raise SystemExit("the stop run was not killed before step 40")
    elif kind == "resume":
        trainer = _trainer(strategy, part, own=own)
        trainer.train(resume_from_checkpoint=True)
        _final(trainer, here)
    elif mode == "refuse":
        lines = {
            "setting": _refused(lambda: _trainer(strategy, part, lowcomm_kwargs={"sync_every": 5})),
            "save_only_model": _refused(lambda: _trainer(strategy, root / strategy / "so")),
        }
        if RANK == 0:
            (here / "lines.json").write_text(json.dumps(lines))
    elif mode == "saveonly":
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer = _trainer(
                strategy, root / strategy / "so", max_steps=20, save_steps=10, save_only_model=True
            )
            trainer.train()
        said = [str(w.message) for w in seen if "save_only_model" in str(w.message)]
        if RANK == 0:
            (here / "said.json").write_text(json.dumps(said))
    elif mode == "best":
        globals_at: dict[int, dict[str, torch.Tensor]] = {}

        class Globals(TrainerCallback):  # the engine's global parameters at each save
            def on_save(self, args, state, control, **kwargs):
                engine = trainer.lowcomm
                globals_at[state.global_step] = {
                    k: v.clone() for k, v in engine.global_state().items()
                }

        trainer = _trainer(
            strategy,
            here / "out",
            callbacks=[Globals()],
            max_steps=30,
            save_steps=10,
            eval_strategy="steps",
            eval_steps=10,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            per_device_eval_batch_size=4,
        )
        trainer.train()
        best = Path(trainer.state.best_model_checkpoint)
        step = int(best.name.rsplit("-", 1)[1])
        saved = load_file(best / "model.safetensors")
        model = trainer.model.state_dict()
        both = [k for k in saved if k in globals_at[step]]
        torch.save(
            {
                "step": step,
                "model_is_saved": all(torch.equal(model[k], v) for k, v in saved.items()),
                "saved_is_global": all(torch.equal(saved[k], globals_at[step][k]) for k in both),
                "compared": len(both),
            },
            here / f"best{RANK}.pt",
        )
        _final(trainer, here)
    else:
        raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    root, plan = Path(sys.argv[1]), sys.argv[2]
    for item in plan.split(","):
        mode, strategy = item.split(":")
        run(root, mode, strategy)


if __name__ == "__main__":
    main()
