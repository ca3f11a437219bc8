"""LoRA: the learner trains a peft adapter on the frozen model; only the adapter moves.

    model = add_adapter(policy, cfg.model)              # cfg.model.lora_rank > 0
    reference = AdapterOff(model)                       # the KL reference: no second copy
    state = adapter_state(model, whole)                 # {"base_model.model...lora_A.weight": [r, in], ...}
    save_adapter(model, "out/hf", state)                # adapter_model.safetensors + adapter_config.json
    merge_adapter("out/hf", "out/merged")               # arbor export out/hf --merge out/merged

The adapter is peft's LoRA: each target linear ``W`` becomes ``W + (alpha / r) · B A`` with
``A`` ``[r, in]`` (random) and ``B`` ``[out, r]`` (zeros, so training starts at the base
model). Directories are peft's format, loadable by ``PeftModel.from_pretrained`` and by
SGLang's ``/load_lora_adapter``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from arbor.config import ModelConfig
from arbor.errors import ConfigError

# model_type -> the modules LoRA wraps by default: every linear of attention and the MLP
# (what the LoRA ablations found best for a fixed parameter budget; peft's own default is q, v).
_ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS: dict[str, list[str]] = {
    model_type: _ATTENTION_AND_MLP for model_type in ("qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2")
}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_targets(model_cfg: ModelConfig, model_type: str) -> list[str]:
    """``model.lora_targets``, else the default of ``model_type`` (an error names the key)."""
    if model_cfg.lora_targets:
        return list(model_cfg.lora_targets)
    if model_type not in DEFAULT_TARGETS:
        raise ConfigError(f"model.lora_targets: no default for model type {model_type!r} "
                          f"(known: {', '.join(sorted(DEFAULT_TARGETS))}); list the module names to adapt")
    return list(DEFAULT_TARGETS[model_type])


def add_adapter(model: Any, model_cfg: ModelConfig) -> Any:
    """``model`` wrapped in a peft LoRA adapter (``model.lora_*``); only the adapter trains.

    Works on a ZeRO-3 partitioned model too: peft sizes the adapter from each linear's
    ``in_features``/``out_features``, never from its (empty) placeholder weight.
    """
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model_cfg, model.config.model_type)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    absent = [t for t in targets if t not in present]
    if absent:
        raise ValueError(f"model.lora_targets: {model_cfg.path} has no modules named {absent} "
                         f"({type(model).__name__})")
    config = LoraConfig(
        r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,  # type: ignore[arg-type]  # peft's stub says int; floats work lora_dropout=model_cfg.lora_dropout,
        target_modules=targets, task_type="CAUSAL_LM",
    )
    if model_cfg.gradient_checkpointing:
        # Reentrant checkpointing needs an input that requires grad; the frozen embedding
        # output does not, so without this the adapter would get no gradient.
        model.enable_input_require_grads()
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = model_cfg.path
    return peft_model


def is_adapter_model(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


class AdapterOff:
    """The policy with its adapter disabled: the base model, called like one.

    The KL reference of a LoRA run: the same modules as the policy (no second copy in
    memory), each call inside peft's ``disable_adapter`` so only the frozen weights act.
    Attribute reads pass through to the policy (``parameters``, ``config``,
    ``get_output_embeddings`` for the chunked LM head).
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def trainable_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The adapter's parameters (the only ones with ``requires_grad``), in module order."""
    return ((name, p) for name, p in model.named_parameters() if p.requires_grad)


def adapter_state(model: Any, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's saved names for the adapter tensors ``whole`` (``named_parameters`` names →
    whole tensors, e.g. gathered from ZeRO-3): ``...q_proj.lora_A.default.weight`` →
    ``...q_proj.lora_A.weight``."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(getattr(model, "module", model), state_dict=whole)


def save_adapter(model: Any, directory: str | Path, state: dict[str, torch.Tensor], tokenizer: Any = None) -> None:
    """An adapter directory in peft's format (``adapter_model.safetensors`` holding ``state``,
    ``adapter_config.json``), plus the tokenizer when given."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)
    model.peft_config["default"].save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, tensors) of a peft adapter directory."""
    import json

    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).exists():
            raise FileNotFoundError(f"{directory} is not a LoRA adapter directory: no {name}")
    return json.loads((directory / ADAPTER_CONFIG).read_text()), load_file(str(directory / ADAPTER_WEIGHTS))


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, base_path: str | None = None) -> Path:
    """Base model + adapter merged into plain weights: an HF directory at ``out_dir``.

    ``base_path``: the base model (default: the adapter's ``base_model_name_or_path``).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, _ = read_adapter(adapter_dir)
    base_path = base_path or config.get("base_model_name_or_path")
    if not base_path:
        raise ValueError(f"{adapter_dir}/{ADAPTER_CONFIG} names no base model: pass --base")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out_dir = Path(out_dir)
    merged.save_pretrained(out_dir, safe_serialization=True)
    source = Path(adapter_dir) if (Path(adapter_dir) / "tokenizer_config.json").exists() else base_path
    AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)
    return out_dir
