"""Hugging Face models through our trainer and through HF's Trainer; the local BPE tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip(
    "transformers", reason="the Hugging Face extra is not installed: pip install 'lowcomm[hf]'"
)
pytest.importorskip("tokenizers", reason="the Hugging Face extra is not installed")
from conftest import run_workers  # noqa: E402
from helpers import tokens  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lowcomm.errors import ConfigError  # noqa: E402
from lowcomm.train.build import build_model  # noqa: E402
from lowcomm.train.data import load_corpus, val_batches  # noqa: E402
from lowcomm.train.model import PRESETS, count_params  # noqa: E402

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
WORDS = (
    "alpha beta gamma delta sync worker outer inner model train step token shard "
    "fragment average momentum"
).split()


def _text_file(path: Path, lines: int = 2500) -> Path:
    """A small deterministic text corpus of word sequences."""
    import random

    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)))
    return path


def _val_loss(model: torch.nn.Module, batches) -> float:
    """Mean cross-entropy of an HF causal LM over (x, y) batches, y already shifted."""
    model.eval()
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
            for x, y in batches
        ]
    return float(torch.stack(losses).mean())


# --- models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_hf_llama_matches_builtin_preset_size(preset):
    # Same width, depth, heads and SwiGLU width, untied head: exactly our decoder's parameter count.
    hf = build_model(f"hf:llama:{preset}", vocab_size=256)
    assert count_params(hf) == count_params(build_model(preset))
    cfg = hf.hf_model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        PRESETS[preset].dim,
        PRESETS[preset].n_layers,
        PRESETS[preset].n_heads,
    )


def test_adapter_loss_is_hf_loss_on_shifted_targets():
    torch.manual_seed(0)
    model = build_model("hf:gpt2:tiny", vocab_size=300, max_seq_len=16)
    hf = model.hf_model
    assert hf.config.n_positions == 16 and hf.config.vocab_size == 300
    assert list(model.state_dict()) == list(hf.state_dict())  # model.pt is an HF state dict
    windows = torch.randint(0, 300, (2, 16))
    x, y = windows[:, :-1], windows[:, 1:]
    # HF shifts labels itself; by causality the logits of x are the first 15 of the window's.
    assert torch.allclose(model(x, y), hf(input_ids=windows, labels=windows).loss, atol=1e-5)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("hf:nosucharch", "unknown Hugging Face model type"),
        ("hf:llama:huge", "unknown size preset"),
        ("hf:./no/such/folder", "does not exist"),
    ],
)
def test_bad_hf_names_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        build_model(spec, vocab_size=256)


def test_config_only_folder_builds_fresh_weights(tmp_path):
    build_model("hf:qwen2:tiny", vocab_size=256).hf_model.config.save_pretrained(tmp_path)
    model = build_model(f"hf:{tmp_path}", vocab_size=256)
    assert type(model.hf_model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ConfigError, match="needs 512 token ids"):
        build_model(f"hf:{tmp_path}", vocab_size=512)
    with pytest.raises(ConfigError, match="exceeds model"):
        build_model(f"hf:{tmp_path}", vocab_size=256, max_seq_len=4096)


# --- tokenizer ------------------------------------------------------------------------------------


def test_bpe_tokenizer_round_trips_and_is_cached(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from lowcomm.train import tokenizer as tk

    byte = load_corpus(str(_text_file(tmp_path / "corpus.txt")))
    bpe = tk.apply_tokenizer(byte, "bpe:300", cache=tmp_path / "cache")
    assert bpe.vocab_size == 300 and max(int(bpe.train.max()), int(bpe.val.max())) < 300
    assert len(bpe.train) < len(byte.train) / 2  # merges of frequent words shorten the text
    assert "300 tokens" in bpe.description and str(len(bpe.val)) in bpe.description
    [path] = (tmp_path / "cache").glob("bpe/*/tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    for ids, text in ((bpe.train, byte.train), (bpe.val, byte.val)):
        assert tok.decode([int(i) for i in ids]) == bytes(text).decode()

    def no_training(*args):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tk, "_train", no_training)
    again = tk.apply_tokenizer(byte, "bpe:300", cache=tmp_path / "cache")
    assert (again.train == bpe.train).all() and (again.val == bpe.val).all()


@pytest.mark.parametrize("spec", ["bpe:100", "bpe", "sentencepiece:4096"])
def test_bad_tokenizer_specs_are_config_errors(spec):
    from lowcomm.train.tokenizer import parse_tokenizer

    with pytest.raises(ConfigError, match="tokenizer"):
        parse_tokenizer(spec)


def test_bpe_refuses_a_pretokenized_corpus(tmp_path):
    (tmp_path / "t.bin").write_bytes(torch.arange(1000, dtype=torch.int16).numpy().tobytes())
    with pytest.raises(ConfigError, match="already tokenized"):
        load_corpus(str(tmp_path / "t.bin"), tokenizer="bpe:512")


# --- our trainer ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,strategy,syncs",
    [
        ("llama", "diloco", 3),  # 12 steps, H = 4: one fragment synced 3 times
        # two fragments (embeddings+head, the blocks), 3 syncs each; by hand (-m slow)
        pytest.param("gpt2", "streaming", 6, marks=pytest.mark.slow),
        pytest.param("llama", "streaming", 6, marks=pytest.mark.slow),
        pytest.param("gpt2", "diloco", 3, marks=pytest.mark.slow),
    ],
)
def test_lowcomm_train_hf_model_reloads_with_from_pretrained(
    tmp_path, monkeypatch, arch, strategy, syncs
):
    data, out = _text_file(tmp_path / "corpus.txt"), tmp_path / "run"
    cmd = LOWCOMM + [
        "train",
        "--strategy",
        strategy,
        "--model",
        f"hf:{arch}:tiny",
        "--workers",
        "2",
        "--steps",
        "12",
        "--out",
        str(out),
        f"data={data}",
        "tokenizer=bpe:300",
        "batch_size=4",
        "seq_len=16",
        "sync_every=4",
        "eval_every=0",
        "eval_batches=4",
        "progress=false",
        "warmup_steps=2",
    ]
    monkeypatch.setenv("LOWCOMM_CACHE", str(tmp_path / "cache"))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    # streaming found the HF model's blocks: P = 2 fragments sync twice as often as one would
    assert summary["syncs"] >= syncs
    corpus_info = json.loads((out / "corpus.json").read_text())
    assert corpus_info["vocab_size"] == 300 and "byte-level BPE" in corpus_info["description"]
    assert "lowcomm: corpus:" in res.stderr

    reloaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    saved = torch.load(out / "model.pt", weights_only=True)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, saved[name]), name
    corpus = load_corpus(str(data), tokenizer="bpe:300")  # from the run's cache
    tok = AutoTokenizer.from_pretrained(out / "hf")  # the run's tokenizer, saved with the model
    text = data.read_text()[:500]
    ids = tok(text)["input_ids"]
    assert len(tok) == 300 and tok.decode(ids) == text
    assert ids[:50] == [int(i) for i in corpus.train[:50]]  # the tokens the model trained on
    batches = val_batches(corpus.val, 4, 16, 4, seed=0)
    assert _val_loss(reloaded, batches) == pytest.approx(summary["final_val_loss"], abs=1e-5)


# --- Hugging Face Trainer -------------------------------------------------------------------------


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _trainer_worker(
    rank: int, world: int, arch: str, strategy: str, out_dir: str, callback_only: bool
) -> dict:
    """One worker of an HF Trainer run on a tiny model: its parameters after every step."""
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lowcomm.hf import LowCommCallback, LowCommTrainer

    # what torchrun would set: Accelerate then runs in multi-process mode (and would wrap in DDP)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.manual_seed(rank)  # different initial weights: training must start from rank 0's
    hf = build_model(f"hf:{arch}:tiny", vocab_size=256, max_seq_len=16).hf_model
    t = torch.from_numpy(tokens(8000)).long()
    data = [{"input_ids": t[i : i + 16], "labels": t[i : i + 16]} for i in range(0, 7680, 16)]
    held_out = [
        {"input_ids": t[i : i + 16], "labels": t[i : i + 16]} for i in range(7700, 7828, 16)
    ]
    snaps: list[torch.Tensor] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snaps.append(_flat(model))

    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=4,
        dataloader_drop_last=True,
        disable_tqdm=True,
        eval_strategy="no" if callback_only else "steps",
        eval_steps=2,
        per_device_eval_batch_size=2,
    )
    if callback_only:
        callback = LowCommCallback(strategy, sync_every=4)
        trainer = Trainer(model=hf, args=args, train_dataset=data, callbacks=[Snapshot(), callback])
        try:
            trainer.train()
        except ConfigError as e:
            callback.engine.close()
            return {"error": str(e)}
        return {"error": None}
    trainer = LowCommTrainer(
        model=hf,
        args=args,
        train_dataset=data,
        eval_dataset=held_out,
        callbacks=[Snapshot()],
        lowcomm_strategy=strategy,
        lowcomm_kwargs={"sync_every": 4},
    )
    trainer.train()
    final = Path(out_dir) / "final"
    if rank == 0:
        trainer.save_model(str(final))
    dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    batches = [(t[i : i + 15][None], t[i + 1 : i + 16][None]) for i in range(7700, 7900, 40)]
    torch.manual_seed(0)  # rank 0's initial weights: the global parameters until the first sync
    start = build_model(f"hf:{arch}:tiny", vocab_size=256, max_seq_len=16).hf_model.eval()
    with torch.no_grad():
        start_loss = float(
            torch.stack(
                [start(**{k: v[None] for k, v in row.items()}).loss for row in held_out]
            ).mean()
        )
    eval_at_2 = [
        h["eval_loss"] for h in trainer.state.log_history if h.get("step") == 2 and "eval_loss" in h
    ]
    return {
        "start_loss": start_loss,
        "eval_at_2": eval_at_2,
        "snaps": torch.stack(snaps),
        "final": _flat(hf),
        "loss": _val_loss(hf, batches),
        "reloaded_loss": _val_loss(reloaded, batches),
        "fragments": len(trainer.lowcomm.fragment_names),
        "syncs": trainer.lowcomm.stats.syncs,
    }


@pytest.mark.parametrize(
    "arch,strategy,fragments,equal_at",
    [
        ("llama", "diloco", 1, {4, 8}),  # H = 4: replicas equal right after each sync only
        # overlapped fragments (tau = 1, alpha = 0.5): never equal; by hand (-m slow)
        pytest.param("gpt2", "streaming", 2, set(), marks=pytest.mark.slow),
    ],
)
def test_lowcomm_trainer_keeps_workers_apart_between_syncs(
    tmp_path, arch, strategy, fragments, equal_at
):
    r0, r1 = run_workers(
        _trainer_worker, 2, arch, strategy, str(tmp_path / "out"), False, tmp_path=tmp_path
    )
    assert r0["fragments"] == fragments
    steps = len(r0["snaps"])
    assert steps == 8
    for step in range(1, steps + 1):
        same = torch.equal(r0["snaps"][step - 1], r1["snaps"][step - 1])
        assert same == (step in equal_at), f"step {step}: workers {'equal' if same else 'differ'}"
    assert torch.equal(r0["final"], r1["final"])  # train end: every worker holds the global model
    assert r0["reloaded_loss"] == pytest.approx(r0["loss"], abs=1e-6)
    if strategy == "diloco":  # evaluate() mid-round sees the global parameters, not the local ones
        assert r0["eval_at_2"] == [pytest.approx(r0["start_loss"], abs=1e-5)]


def test_callback_in_a_plain_trainer_refuses_ddp(tmp_path):
    # transformers.Trainer wraps the model in DDP under multi-process Accelerate: identical
    # gradients on every worker, which the callback detects at the first step.
    results = run_workers(
        _trainer_worker, 2, "llama", "diloco", str(tmp_path / "out"), True, tmp_path=tmp_path
    )
    for r in results:
        assert r["error"] is not None and "identical on every worker" in r["error"]


# --- a Trainer run resumed from its own checkpoint --------------------------------------------

RESUME_SCRIPT = Path(__file__).parent / "hf_resume_script.py"


def _torchrun_hf(out: Path, plan: str, kill_after: Path | None = None) -> str:
    """``torchrun --nproc-per-node 2 hf_resume_script.py OUT PLAN``; with ``kill_after`` (a
    checkpoint folder), every process of it is SIGKILLed from here once that checkpoint is
    whole (the Trainer's files and both ranks' engine files). Returns the output."""
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(RESUME_SCRIPT),
        str(out),
        plan,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    log = out / f"torchrun-{plan.replace(':', '-').replace(',', '_')}.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            if kill_after is None:
                assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
                return log.read_text()
            need = [
                "trainer_state.json",
                "rng_state_0.pth",
                "rng_state_1.pth",
                "lowcomm-rank0.pt",
                "lowcomm-rank1.pt",
            ]
            deadline = time.monotonic() + 300
            while not all((kill_after / n).exists() for n in need):
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "no whole checkpoint in 300 s"
                time.sleep(0.05)
            # torchrun starts its workers in sessions of their own: kill the whole tree
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid``, read from /proc (children before their parents' turn)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _same_finals(root: Path, strategy: str, a: str, b: str) -> None:
    for rank in (0, 1):
        x = torch.load(root / strategy / a / f"final{rank}.pt", weights_only=True)
        y = torch.load(root / strategy / b / f"final{rank}.pt", weights_only=True)
        assert x.keys() == y.keys()
        worst = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
        assert all(torch.equal(x[k], y[k]) for k in x), f"{strategy} rank {rank}: off by {worst}"


def _killed_and_resumed(root: Path, strategies: list[str], own: bool = False) -> None:
    """For each strategy: the uninterrupted run, the run killed after its checkpoint at step
    20, and its resume; each resume's launch also starts the next strategy's killed run."""
    pre = "own-" if own else ""
    plan = [f"{pre}full:{s}" for s in strategies]
    for s in strategies:
        part = root / s / f"{pre}part"
        _torchrun_hf(root, ",".join([*plan, f"{pre}stop:{s}"]), kill_after=part / "checkpoint-20")
        assert not (part / "checkpoint-40").exists()
        plan = [f"{pre}resume:{s}"]
    _torchrun_hf(root, ",".join(plan))


@pytest.fixture(scope="module")
def hf_resumed(tmp_path_factory):
    """DiLoCo and SparseLoCo runs killed after a checkpoint and resumed, beside the runs that
    check save_only_model, load_best_model_at_end and the refusals (three torchrun starts)."""
    root = tmp_path_factory.mktemp("hf-resume")
    part = root / "diloco" / "part"
    _torchrun_hf(
        root,
        "full:diloco,full:sparseloco,saveonly:diloco,best:diloco,stop:diloco",
        kill_after=part / "checkpoint-20",
    )
    _torchrun_hf(
        root,
        "refuse:diloco,resume:diloco,stop:sparseloco",
        kill_after=root / "sparseloco" / "part" / "checkpoint-20",
    )
    _torchrun_hf(root, "resume:sparseloco")
    return root


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_a_trainer_run_killed_after_a_checkpoint_resumes_bit_for_bit(hf_resumed, strategy):
    # the engine's state (global copy, outer state, error feedback, schedule) and each rank's
    # own inner optimizer come back: the resumed run ends where the uninterrupted one does
    _same_finals(hf_resumed, strategy, "full", "resume")
    # save_total_limit=1 rotated the engine's files with their checkpoint
    full = hf_resumed / strategy / "full" / "out"
    assert sorted(p.name for p in full.iterdir()) == ["checkpoint-40"]
    assert {p.name for p in (full / "checkpoint-40").glob("lowcomm-*")} == {
        "lowcomm-rank0.pt",
        "lowcomm-rank1.pt",
    }


def test_a_resume_of_another_setting_or_of_a_model_only_checkpoint_is_refused(hf_resumed):
    lines = json.loads((hf_resumed / "diloco" / "refuse" / "lines.json").read_text())
    part = hf_resumed / "diloco" / "part" / "checkpoint-20"
    assert lines["setting"] == (
        f"checkpoint {part} was written with other engine settings: sync_every=10 (this run: "
        f"5); resume with the checkpoint's settings, or pass lowcomm_resume='model' to "
        f"LowCommTrainer to start the outer loop afresh from its saved model"
    )
    assert lines["save_only_model"].startswith(
        f"checkpoint {hf_resumed / 'diloco' / 'so' / 'checkpoint-20'} holds no lowcomm engine "
        f"state (lowcomm-rank"
    )
    assert "save_only_model=True" in lines["save_only_model"]
    said = json.loads((hf_resumed / "diloco" / "saveonly" / "said.json").read_text())
    assert said and "cannot resume the outer loop" in said[0]
    assert not list((hf_resumed / "diloco" / "so").glob("*/lowcomm-*"))


def test_load_best_model_at_end_loads_the_best_global_parameters(hf_resumed):
    best = [torch.load(hf_resumed / "diloco" / "best" / f"best{r}.pt") for r in (0, 1)]
    for b in best:  # the model at the end is the best checkpoint's, which is the global copy
        assert b["model_is_saved"] and b["saved_is_global"] and b["compared"] >= 20
    finals = [
        torch.load(hf_resumed / "diloco" / "best" / f"final{r}.pt", weights_only=True)
        for r in (0, 1)
    ]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategies,own",
    [(["diloco", "streaming", "sparseloco", "co2"], False), (["co2"], True)],
    ids=["LowCommTrainer", "LowCommCallback"],
)
def test_every_strategy_and_the_callback_resume_bit_for_bit(tmp_path, strategies, own):
    _killed_and_resumed(tmp_path, strategies, own)
    for s in strategies:
        _same_finals(tmp_path, s, f"{'own-' if own else ''}full", f"{'own-' if own else ''}resume")


# --- the refusals, each with its one line ------------------------------------------------------


def _saved(tmp_path: Path, **identity) -> tuple[Path, object]:
    """A checkpoint folder with rank 0's and rank 1's engine files of a DiLoCo run on 2."""
    from lowcomm.config import SyncConfig
    from lowcomm.hf.resume import RunIdentity, save_state

    ident = RunIdentity.of("diloco", 2, SyncConfig(sync_every=10))
    ident = RunIdentity(**{**ident.__dict__, **identity})
    ckpt = tmp_path / "checkpoint-20"
    for rank in (0, 1):
        save_state(ckpt, rank, ident, 20, {"step": 20}, {"state": {}, "param_groups": []})
    return ckpt, ident


FRESH = "resume='model' to LowCommCallback"
AFRESH = f"or pass {FRESH} to start the outer loop afresh from its saved model"


def test_the_engine_file_loads_back_for_its_own_run(tmp_path):
    from lowcomm.hf.resume import load_state

    ckpt, ident = _saved(tmp_path)
    assert load_state(ckpt, 1, ident, 20, FRESH) == {
        "engine": {"step": 20},
        "optimizer": {"state": {}, "param_groups": []},
    }


@pytest.mark.parametrize(
    "change,line",
    [
        (
            {"strategy": "sparseloco"},
            "checkpoint {c} was written by strategy 'diloco' and this run is 'sparseloco': "
            "resume with strategy 'diloco', " + AFRESH,
        ),
        (
            {"world_size": 3},
            "checkpoint {c} was written by 2 workers and this run has 3: resume it on 2 "
            "workers (torchrun --nproc-per-node 2), " + AFRESH,
        ),
    ],
)
def test_a_resume_of_another_strategy_or_world_size_is_refused(tmp_path, change, line):
    from lowcomm.hf.resume import RunIdentity, load_state

    ckpt, ident = _saved(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_state(ckpt, 0, RunIdentity(**{**ident.__dict__, **change}), 20, FRESH)
    assert str(err.value) == line.format(c=ckpt)


def test_a_resume_on_more_workers_than_wrote_it_names_the_world_size(tmp_path):
    from lowcomm.hf.resume import RunIdentity, load_state

    ckpt, ident = _saved(tmp_path)
    with pytest.raises(ConfigError, match="written by 2 workers and this run has 3"):
        load_state(ckpt, 2, RunIdentity(**{**ident.__dict__, "world_size": 3}), 20, FRESH)


def test_a_resume_with_several_other_settings_names_them(tmp_path):
    from lowcomm.config import SyncConfig
    from lowcomm.hf.resume import RunIdentity, load_state

    ckpt, _ = _saved(tmp_path)
    now = RunIdentity.of("diloco", 2, SyncConfig(sync_every=20, outer_lr=0.5))
    with pytest.raises(ConfigError) as err:
        load_state(ckpt, 0, now, 20, FRESH)
    assert str(err.value) == (
        f"checkpoint {ckpt} was written with other engine settings: outer_lr=0.7 (this run: "
        f"0.5), sync_every=10 (this run: 20); resume with the checkpoint's settings, {AFRESH}"
    )


def test_a_torn_renamed_or_stale_engine_file_is_refused(tmp_path):
    from lowcomm.errors import CheckpointError
    from lowcomm.hf.resume import load_state, state_path

    ckpt, ident = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="come from different saves"):
        load_state(ckpt, 0, ident, 30, FRESH)  # the Trainer's state is of another save
    zero, one, spare = state_path(ckpt, 0), state_path(ckpt, 1), ckpt / "spare"
    one.replace(spare)  # the two ranks' files swapped
    zero.replace(one)
    spare.replace(zero)
    with pytest.raises(CheckpointError, match="holds rank 1's state, not rank 0's"):
        load_state(ckpt, 0, ident, 20, FRESH)
    zero.write_bytes(zero.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"cannot be read .*resume from an earlier"):
        load_state(ckpt, 0, ident, 20, FRESH)
    for path in ckpt.glob("lowcomm-*"):
        path.unlink()
    with pytest.raises(CheckpointError, match="holds no lowcomm engine state"):
        load_state(ckpt, 0, ident, 20, FRESH)


def test_the_callback_refuses_what_it_cannot_follow():
    from types import SimpleNamespace

    from lowcomm.hf import LowCommCallback, LowCommTrainer

    with pytest.raises(ConfigError, match="resume='later': use one of exact, model"):
        LowCommCallback("diloco", resume="later")
    with pytest.raises(ConfigError, match="lowcomm_resume='later': use one of exact, model"):
        LowCommTrainer(lowcomm_resume="later")
    model = torch.nn.Linear(2, 2)
    args = SimpleNamespace(load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="cannot follow load_best_model_at_end=True"):
        LowCommCallback("diloco").on_train_begin(
            args, None, None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1)
        )
