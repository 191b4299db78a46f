"""Groups in, new weights out.

    loop.py        Trainer: the RL loop (rollout → buffer → advantages → update → weight sync → eval → checkpoint)
                   and PolicyLoss, GRPO's per-token loss
    learner.py     Learner: the policy as it trains (LoRA, FSDP, KL reference, optimizer, scheduler),
                   update(samples, loss_fn) over packed micro-batches, weight sync; RL and SFT share it
    samples.py     TrainSample, group-relative advantages, the resumable prompt sampler
    evaluation.py  held-out evaluation through the rollout; metrics.jsonl and the console lines
    buffer.py      TrajectoryBuffer: admission by the staleness bound, the ledger of every admitted prompt
    algos.py       GRPO/RLOO advantages, clipped losses, KL, TIS/MIS: pure tensors
    packing.py     packed sequences without padding; logits only where the loss mask is 1
    parallel.py    one process or N FSDP2 ranks behind one object
    checkpoint.py  sharded checkpoints of the learner and the loop's state that resume at any world size; HF export
    weights.py     whole weights out of a sharded / LoRA policy, streamed to the engines in buckets
    lora.py        peft LoRA adapters
    runs.py        run directories, --resume, --overwrite
    sft.py         `turnrl sft`: multi-turn SFT on the RL masks, the Learner with masked_nll
    ray.py         trainer ranks as Ray actors
"""
