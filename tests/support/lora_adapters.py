"""LoRA adapters made with peft itself on a test model: random, non-zero A and B, saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out_dir: Path, settings: dict, seed: int, b_scale: float = 20.0,
                      base=None):
    """Write an adapter of `settings` (peft.LoraConfig arguments) for the model in `base_dir` (or the
    transformers model `base`, left unchanged) to `out_dir`; return the peft model, in eval mode. peft's
    random B is small; `b_scale` makes each adapter change the tokens."""
    import copy

    import peft
    import transformers

    torch.manual_seed(seed)
    model = (copy.deepcopy(base) if base is not None else
             transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **settings)
    lora_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    lora_model.save_pretrained(out_dir)
    return lora_model.eval()
