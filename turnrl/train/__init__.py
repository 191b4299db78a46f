"""Groups in, new weights out.

    loop.py        Trainer: the RL loop (rollout → buffer → advantages → update → weight sync → eval → checkpoint)
    buffer.py      TrajectoryBuffer: admission by the staleness bound, the ledger of every admitted prompt
    algos.py       GRPO/RLOO advantages, clipped losses, KL, TIS/MIS: pure tensors
    packing.py     packed sequences without padding; logits only where the loss mask is 1
    parallel.py    one process or N FSDP2 ranks behind one object
    checkpoint.py  sharded checkpoints that resume at any world size; Hugging Face export
    weights.py     whole weights out of a sharded / LoRA policy, streamed to the engines in buckets
    lora.py        peft LoRA adapters
    runs.py        run directories, --resume, --overwrite
    sft.py         `turnrl sft`: multi-turn SFT on the RL masks
    ray.py         trainer ranks as Ray actors
"""
