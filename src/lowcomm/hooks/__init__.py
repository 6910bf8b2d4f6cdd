"""Per-step gradient reduction: DDP communication hooks and LoCo's FSDP2 reduce-scatter.

- :mod:`.ddp`: the FP32 all-reduce hook, metered (the baseline), and the registry of the others
  a run may name (``ddp_hook=``: the lab's PyTorch bf16 and PowerSGD);
- :mod:`.loco_ddp`: LoCo's compensated low-bit DDP hook;
- :mod:`.loco_fsdp`: LoCo as FSDP2's custom reduce-scatter;
- :mod:`.loco_common`: the quantiser choice and fp16 loss-scale handling both LoCo paths share.
"""
