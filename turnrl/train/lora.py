"""LoRA adapters on the policy (peft), and the merged weights the engines receive.

    policy = apply_lora(policy, cfg.trainer.lora)   # only the adapters require grad
    with policy.disable_adapter(): ...              # the base model, e.g. the KL reference (no second copy)

Engines load plain Hugging Face weights, so a weight sync sends, for each adapted linear layer, its merged
weight W + (alpha / r) · B·A under the unwrapped model's name; the base weights never change and the
engines already hold them. Only the adapters (and their optimizer state) are checkpointed.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from turnrl.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter we train


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap `model` with LoRA adapters on `cfg.target_modules`; everything else is frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    alpha: Any = cfg.alpha  # peft annotates an int and scales by any number
    return get_peft_model(model, PeftLoraConfig(r=cfg.r, lora_alpha=alpha, lora_dropout=cfg.dropout,
                                                target_modules=cfg.target_modules, bias="none"))


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def base_model(model: nn.Module) -> Any:
    """The Hugging Face model under a peft wrapper (the model itself without one): a PreTrainedModel."""
    return cast(Any, model).get_base_model() if is_lora(model) else model


def hf_name(name: str) -> str:
    """A parameter's name in the unwrapped Hugging Face model (peft adds a prefix and `base_layer`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def adapted_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """(name, peft LoraLayer) for every adapted linear layer, in module order."""
    if not is_lora(model):
        return []
    from peft.tuners.lora import LoraLayer

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, m in layers:
        if m.use_dora.get(ADAPTER) or getattr(m, "fan_in_fan_out", False) or m.merged:
            raise ValueError(f"{name}: only plain LoRA on nn.Linear is supported (no DoRA, Conv1D, or merged adapters)")
    return layers


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling · B·A in fp32 (W [out, in], A [r, in], B [out, r])."""
    return weight.float() + scaling * (lora_b.float() @ lora_a.float())
