"""The trainer's memory per rank by model size and world size, computed from parameter counts (docs/distributed.md).

    .venv/bin/python scripts/memory_table.py            # markdown tables

Parameter counts come from the models' architectures, built on the meta device (no weights, no download) from
the shapes of their Hugging Face configs (Qwen3 0.6B to 32B, Qwen3-VL-2B); they match the model cards'
figures. Per rank, with `trainer.parallel: fsdp` over W ranks (turnrl.train.parallel):

    full fine-tuning   16 P / W bytes: fp32 sharded weights (4) + fp32 gradients (4) + AdamW m and v (8)
    + KL reference      4 P / W       (algo.kl_coef > 0 without LoRA: a frozen fp32 copy, sharded the same way)
    LoRA                4 P / W + 16 A / W   (the frozen base is sharded in fp32 too; A = adapter parameters)

Not counted: activations (set by optim.micro_batch_tokens and optim.gradient_checkpointing), the bf16 copy
of the one or two layers FSDP has gathered at a time, rank 0's weight-sync bucket (weight_sync.bucket_mb),
and the CUDA/NCCL context. With trainer.cpu_offload the sharded state lives in host memory instead. Engines
hold their own bf16 copy, 2 P bytes each, plus the KV cache they are configured to take.
"""

from __future__ import annotations

import torch

QWEN3 = {  # name: (hidden, layers, intermediate, attention heads, tied embeddings); 8 KV heads of 128 dims
    "Qwen3-0.6B": (1024, 28, 3072, 16, True),
    "Qwen3-1.7B": (2048, 28, 6144, 16, True),
    "Qwen3-4B": (2560, 36, 9728, 32, True),
    "Qwen3-8B": (4096, 36, 12288, 32, False),
    "Qwen3-14B": (5120, 40, 17408, 40, False),
    "Qwen3-32B": (5120, 64, 25600, 64, False),
}
WORLD_SIZES = (1, 2, 4, 8, 16, 32)
LORA_RANK = 64  # examples/distributed/qwen3-8b-lora.yaml: r 64 on every linear layer but the LM head


def _text_config(hidden: int, layers: int, intermediate: int, heads: int, tied: bool) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": intermediate,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
            "tie_word_embeddings": tied}


def models() -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3Config, Qwen3VLConfig

    out = {}
    with torch.device("meta"):
        for name, shape in QWEN3.items():
            out[name] = AutoModelForCausalLM.from_config(Qwen3Config(**_text_config(*shape)))
        vl = Qwen3VLConfig(text_config=_text_config(*QWEN3["Qwen3-1.7B"]), tie_word_embeddings=True,
                           vision_config={"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                                          "patch_size": 16, "out_hidden_size": 2048, "num_position_embeddings": 2304,
                                          "deepstack_visual_indexes": [5, 11, 17]})
        out["Qwen3-VL-2B"] = AutoModelForImageTextToText.from_config(vl)
    return out


def lora_parameters(model: torch.nn.Module, r: int = LORA_RANK) -> int:
    """r (in + out) per linear layer but the LM head: what peft's all-linear targets (a VLM's vision tower
    included)."""
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in name)


def gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f}" if n_bytes < 100e9 else f"{n_bytes / 1e9:.0f}"


def main() -> None:
    built = models()
    print("Full fine-tuning: fp32 weights + gradients + AdamW state per rank (GB = 1e9 bytes)\n")
    print("| model | parameters | " + " | ".join(f"W={w}" for w in WORLD_SIZES) + " | engine bf16 weights |")
    print("|---" * (len(WORLD_SIZES) + 3) + "|")
    for name, model in built.items():
        p = sum(t.numel() for t in model.parameters())
        print(f"| {name} | {p / 1e9:.2f} B | " + " | ".join(gb(16 * p / w) for w in WORLD_SIZES) + f" | {gb(2 * p)} |")
    print(f"\nLoRA r={LORA_RANK} on every linear layer: frozen fp32 base + adapters with gradients and AdamW state\n")
    print("| model | adapter parameters | " + " | ".join(f"W={w}" for w in WORLD_SIZES) + " |")
    print("|---" * (len(WORLD_SIZES) + 2) + "|")
    for name, model in built.items():
        p, a = sum(t.numel() for t in model.parameters()), lora_parameters(model)
        print(f"| {name} | {a / 1e6:.0f} M | " + " | ".join(gb((4 * p + 16 * a) / w) for w in WORLD_SIZES) + " |")


if __name__ == "__main__":
    main()
