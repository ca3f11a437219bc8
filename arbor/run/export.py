"""``arbor export``: a trained LoRA adapter merged into its base model, as plain HF weights.

    arbor export runs/quick/hf --merge runs/quick/merged            # base: the adapter's own
    arbor export runs/quick/hf --merge merged --base Qwen/Qwen2.5-0.5B-Instruct

A LoRA run (``model.lora_rank`` > 0) writes its ``hf/`` export and checkpoints'
``learner/adapter`` in peft's format; the merged directory loads with
``AutoModelForCausalLM.from_pretrained`` and serves on any engine without LoRA support.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arbor export", description=__doc__.splitlines()[0])
    parser.add_argument("adapter", help="a peft adapter directory (a LoRA run's hf/ or learner/adapter)")
    parser.add_argument("--merge", required=True, metavar="OUT", help="write the merged model here")
    parser.add_argument("--base", default=None, help="the base model (default: the adapter's base_model_name_or_path)")
    args = parser.parse_args(argv)
    from arbor.train.lora import merge_adapter

    try:
        out = merge_adapter(args.adapter, args.merge, args.base)
    except (FileNotFoundError, ValueError) as e:
        print(f"arbor export: {e}", file=sys.stderr)
        return 1
    print(f"arbor export: merged {args.adapter} into {out}")
    return 0
