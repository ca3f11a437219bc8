"""Build the quickstart's tiny model: a tokenizer and a small Qwen2 warm-started on arithmetic.

    python scripts/build_tiny_model.py                      # -> models/tiny-arith, data/arith
    python scripts/build_tiny_model.py --steps 50 --out /tmp/tiny --data /tmp/arith

No download: the byte-level BPE tokenizer is trained here on the synthetic corpus, the
model (Qwen2 architecture, ~1M parameters, a few MB) starts from random weights and is
supervised on problems like "What is 37+48?" answered "37+48=85 \\boxed{85}", with
arbor's tree-packed SFT loss. It stops early on purpose (``--steps``): the quickstart's
RL run needs a policy that is right sometimes, not always, so that accuracy can rise.
Writes the model directory (HF format, loadable by transformers and SGLang) and
``train.jsonl`` / ``test.jsonl`` problem files with ``id``, ``prompt``, ``answer``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.logprobs import sft_loss  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INSTRUCTION = " Put the answer in \\boxed{}."


def make_problem(rng: random.Random, index: int) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-")
    if op == "-" and b > a:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    return {"id": f"arith-{index}", "prompt": f"What is {a}{op}{b}?", "answer": str(answer),
            "solution": f"{a}{op}{b}={answer} \\boxed{{{answer}}}"}


def build_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[:2],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_ids(tokenizer, problem: dict) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem["prompt"] + INSTRUCTION}], add_generation_prompt=True,
        tokenize=True,
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int = 24) -> float:
    """Greedy answers checked by exact match of the boxed number."""
    correct = 0
    for problem in problems:
        ids = torch.tensor([prompt_ids(tokenizer, problem)])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        correct += f"\\boxed{{{problem['answer']}}}" in text
    return correct / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "models" / "tiny-arith"))
    parser.add_argument("--data", default=str(REPO / "data" / "arith"))
    parser.add_argument("--steps", type=int, default=300, help="SFT steps (fewer: a weaker start)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=100)
    args = parser.parse_args()

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    problems = [make_problem(rng, i) for i in range(4000)]
    train, test = problems[:3800], problems[3800:]
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with (data / f"{name}.jsonl").open("w") as f:
            for p in rows:
                f.write(json.dumps({k: p[k] for k in ("id", "prompt", "answer")}) + "\n")

    corpus = [p["prompt"] + INSTRUCTION + " " + p["solution"] for p in train]
    out = Path(args.out)
    build_tokenizer(corpus, args.vocab).save_pretrained(out)
    # Train with the tokenizer users will load: transformers 5 loads it as Qwen2Tokenizer,
    # whose own pre-tokenizer (digits one by one) differs from the one it was trained with.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    eos = tokenizer.eos_token_id
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    t0 = time.monotonic()
    model.train()
    for step in range(args.steps):
        batch = rng.sample(train, args.batch)
        trees = [
            RolloutTree.from_sequences(prompt_ids(tokenizer, p), [tokenizer(p["solution"])["input_ids"] + [eos]])
            for p in batch
        ]
        loss = sft_loss(model, trees)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}/{args.steps}  loss {loss.item():.3f}  {time.monotonic() - t0:.0f} s", flush=True)
    model.eval()
    acc = accuracy(model, tokenizer, test[: args.eval_problems])
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    print(f"greedy accuracy on {args.eval_problems} held-out problems: {acc:.2f}")
    print(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 2**20:.1f} MiB) and {data}")


if __name__ == "__main__":
    main()
