"""Per-step gradient reduction: DDP communication hooks and LoCo's FSDP2 reduce-scatter.

- :mod:`.ddp`: the FP32 all-reduce hook and PyTorch's bf16 / PowerSGD hooks, metered (baselines);
- :mod:`.loco_ddp`: LoCo's compensated low-bit DDP hook;
- :mod:`.loco_fsdp`: LoCo as FSDP2's custom reduce-scatter;
- :mod:`.loco_common`: the quantiser choice and fp16 loss-scale handling both LoCo paths share;
- :mod:`.patches`: the one process-wide monkeypatch (metering ``dist.all_reduce``), undoable.
"""
