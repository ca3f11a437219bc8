"""Build the quickstart's tiny model: a tokenizer and a small Qwen2 warm-started on arithmetic.

    python scripts/build_tiny_model.py                      # -> models/tiny-arith, data/arith
    python scripts/build_tiny_model.py --steps 50 --out /tmp/tiny --data /tmp/arith
    python scripts/build_tiny_model.py --task cot            # -> models/tiny-cot, data/cot
    python scripts/build_tiny_model.py --task lookup         # -> models/tiny-lookup, data/lookup

``--task cot`` builds the chain-of-thought variant (``scripts/cot_task.py``): the same
tokenizer recipe and architecture, warm-started on six-digit column additions worked
digit by digit (~65 answer tokens before ``\\boxed{}``), some of them with a slip carried
through (``--corrupt``), and stopped as soon as its *greedy* validation accuracy reaches
``--target-acc`` (default 0.3): the start of ``scripts/bench_learning.py``'s RL runs.
``--task lookup`` (``scripts/lookup_task.py``) is built alike: a long shared context (a
26-entry table in the prompt) and a short decision (two entries read and added, ~20 tokens).
Its warm-up runs all its ``--steps`` (3,000): it must learn to read the table, and it learns to
prefer the neighbour's entry (``--corrupt`` 0.55 per read), so greedy answers start mostly
wrong (19.5% right on the test problems) and RL has room.

No download: the byte-level BPE tokenizer (digits always one per token) is trained here on
the synthetic corpus, the model (Qwen2 architecture, ~0.9M parameters, 3.4 MB) starts
from random weights and is supervised on problems like "What is 37+48?" answered
"37+48=85 \\boxed{85}" by ``arbor sft``'s step (``arbor.run.sft.sft_step`` on a plain-torch
learner, each problem a one-branch tree example). The prompts are exactly what
``arbor train`` feeds the model with ``model.chat_template: true``,
``data.prompt_suffix: PROMPT_SUFFIX`` and no system prompt (``arbor.data.format_prompt``).

It stops early on purpose: the quickstart's RL run needs a policy that is right
sometimes, not always, when sampled at temperature 1.0, so that accuracy can rise.
Training ends at ``--steps`` or as soon as the sampled accuracy on a validation slice
reaches ``--target-acc``. Writes the model directory (HF format, loadable by
transformers and SGLang) and ``train.jsonl`` / ``test.jsonl`` problem files with ``id``,
``prompt``, ``answer``; the last line printed is
``RESULT sampled_acc=... greedy_acc=... params=... build_s=...``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.config import DataConfig, LearnerConfig, LossConfig, ModelConfig, OptimConfig  # noqa: E402
from arbor.data import format_prompt  # noqa: E402
from arbor.run.sft import SftExample, encode_example, sft_step  # noqa: E402
from arbor.train.learner import Learner  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
import cot_task  # noqa: E402
import lookup_task  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The quickstart's data.prompt_suffix (model.chat_template: true, data.system_prompt: null).
PROMPT_SUFFIX = " Put the answer in \\boxed{}."
DATA_CFG = DataConfig(prompt_suffix=PROMPT_SUFFIX, system_prompt=None)
N_PROBLEMS = 4000  # at most; fewer when the operand range has fewer distinct problems
# --task cot / lookup: test, valid, train (RL) and the warm-up's problems, all distinct.
COT_SPLITS = {"test": 200, "valid": 100, "train": 1000, "sft": 20000}
WORKED_TASKS = {"cot": cot_task, "lookup": lookup_task}  # worked answers, stopped on greedy accuracy


def make_problem(rng: random.Random, index: int, max_operand: int) -> dict[str, str]:
    """``a+b`` or ``a-b`` (never negative) with operands in [0, max_operand]."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice("+-")
    if op == "-" and b > a:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    return {"id": f"arith-{index}", "prompt": f"What is {a}{op}{b}?", "answer": str(answer),
            "solution": f"{a}{op}{b}={answer} \\boxed{{{answer}}}"}


def make_problems(seed: int, max_operand: int) -> list[dict[str, str]]:
    """Distinct problems (no prompt in two splits), in a seeded order."""
    n = min(N_PROBLEMS, (max_operand + 1) ** 2 + (max_operand + 1) * (max_operand + 2) // 2)  # distinct a+b, a-b
    return cot_task.distinct_problems(lambda rng, index: make_problem(rng, index, max_operand), seed, n)


def build_tokenizer(corpus: list[str], vocab_size: int, out: Path) -> Any:
    """Byte-level BPE that never merges digits, saved to ``out`` and reloaded from there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, additional_special_tokens=SPECIAL[:2],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # Train with the tokenizer users will load (transformers picks the class from the files).
    return AutoTokenizer.from_pretrained(out)


def tiny_qwen2(tokenizer: Any, hidden: int, layers: int, max_positions: int = 256) -> Any:
    """A randomly initialised Qwen2 for ``tokenizer``: heads of 32, an MLP 3x wide, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
        max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


def save_model(model: Any, tokenizer: Any, out: Path) -> None:
    """The warmed-up model in eval mode, saved with a generation config that stops on the EOS."""
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def prompt_ids(tokenizer: Any, problem: dict[str, str]) -> list[int]:
    """Exactly what ``arbor train`` feeds the policy for this problem."""
    return format_prompt(problem, DATA_CFG, tokenizer, chat_template=True)


def answer_ids(tokenizer: Any, problem: dict[str, str]) -> list[int]:
    return list(tokenizer(problem["solution"], add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def sft_example(tokenizer: Any, problem: dict[str, str]) -> SftExample:
    """The problem as an ``arbor sft`` data line: the prompt and one branch, the solution."""
    row = {"prompt": problem["prompt"], "branches": [problem["solution"]]}
    return encode_example(row, problem["id"], tokenizer, DATA_CFG, chat_template=True, max_tokens=256)


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, problems: Sequence[dict[str, str]], samples: int,
             seed: int, max_new_tokens: int = 32) -> dict[str, float]:
    """Accuracy (exact match of the last boxed number) and format rate of ``samples``
    completions per problem at temperature 1.0 (``samples=0``: one greedy completion).

    Prompts of equal length go in one batch, so no padding is involved."""
    from arbor.rollout.answers import last_boxed

    generator = torch.Generator().manual_seed(seed)
    groups: dict[int, list[tuple[dict[str, str], list[int]]]] = defaultdict(list)
    for p in problems:
        ids = prompt_ids(tokenizer, p)
        groups[len(ids)].append((p, ids))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    correct = formatted = total = 0
    lengths: list[int] = []
    for _, group in sorted(groups.items()):
        for start in range(0, len(group), 64):
            chunk = group[start:start + 64]
            reps = max(samples, 1)
            x = torch.tensor([ids for _, ids in chunk for _ in range(reps)])
            done = torch.zeros(len(x), dtype=torch.bool)
            past, inp, out = None, x, []
            for _ in range(max_new_tokens):
                res = model(input_ids=inp, past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[:, -1].float()
                if samples:
                    nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
                else:
                    nxt = logits.argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                out.append(nxt)
                done |= nxt == eos
                if done.all():
                    break
                inp = nxt[:, None]
            gen = torch.stack(out, 1).tolist()
            for i, toks in enumerate(gen):
                p = chunk[i // reps][0]
                ended = eos in toks
                toks = toks[: toks.index(eos)] if ended else toks
                lengths.append(len(toks) + ended)
                text = tokenizer.decode(toks, skip_special_tokens=True)
                boxed = last_boxed(text)
                correct += boxed is not None and boxed.strip() == p["answer"]
                formatted += ended and boxed is not None and text.rstrip().endswith("}")
                total += 1
    return {"acc": correct / total, "format": formatted / total, "max_len": max(lengths),
            "mean_len": sum(lengths) / len(lengths)}


def split_problems(args: argparse.Namespace) -> dict[str, list[dict[str, str]]]:
    """The task's problems in disjoint splits: test (reported), valid (early stopping),
    train (the RL run's problems, never seen in SFT, so RL has to generalise too) and sft."""
    if args.task in WORKED_TASKS:
        problems = WORKED_TASKS[args.task].make_problems(args.seed, sum(COT_SPLITS.values()), args.corrupt)
        splits, start = {}, 0
        for name, count in COT_SPLITS.items():
            splits[name], start = problems[start:start + count], start + count
        return splits
    problems = make_problems(args.seed, args.max_operand)
    n_test, n_valid = min(200, len(problems) // 5), min(100, len(problems) // 10)
    n_train = (len(problems) - n_test - n_valid) * 2 // 5
    return {"test": problems[:n_test], "valid": problems[n_test:n_test + n_valid],
            "train": problems[n_test + n_valid:n_test + n_valid + n_train],
            "sft": problems[n_test + n_valid + n_train:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["arith", "cot", "lookup"], default="arith",
                        help="arith: the quickstart's a+b; cot: six-digit addition worked column by column; "
                             "lookup: two entries of a 26-entry table in the prompt, added")
    parser.add_argument("--out", default=None, help="default: models/tiny-<task>")
    parser.add_argument("--data", default=None, help="default: data/<task>")
    parser.add_argument("--steps", type=int, default=None, help="SFT steps at most (default 2500; lookup 3000)")
    parser.add_argument("--target-acc", type=float, default=None,
                        help="stop once the validation accuracy reaches this: sampled (T=1) for arith "
                             "(default 0.35), greedy for cot (default 0.3)")
    parser.add_argument("--corrupt", type=float, default=None,
                        help="cot: share of warm-up solutions with one column sum off by one (default 0.25); "
                             "lookup: chance that each of the two reads takes the neighbour's value (default 0.55)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="SFT steps between validation evals; default 100 (5 with --task cot, whose greedy "
                             "accuracy jumps within a few dozen steps: 0.11 -> 0.31 between steps 395 and 415)")
    parser.add_argument("--eval-from", type=int, default=None,
                        help="no validation before this step; default 0 (250 with --task cot)")
    parser.add_argument("--val-problems", type=int, default=100, help="validation problems for early stopping")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-operand", type=int, default=29)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=200, help="test problems for the final report")
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per test problem at T=1")
    args = parser.parse_args()
    cot = args.task in WORKED_TASKS  # cot and lookup are built alike
    args.out = args.out or str(REPO / "models" / f"tiny-{args.task}")
    args.data = args.data or str(REPO / "data" / args.task)
    args.steps = args.steps or (3000 if args.task == "lookup" else 2500)
    args.corrupt = args.corrupt if args.corrupt is not None else (0.55 if args.task == "lookup" else 0.25)
    # lookup trains to the end: its warm-up must have learned to read the table (the slips are
    # then a preference RL can reverse); stopped at 30% it was still learning the reading itself.
    default_target = {"cot": 0.3, "lookup": 1.01}.get(args.task, 0.35)
    args.target_acc = args.target_acc if args.target_acc is not None else default_target
    args.eval_every = args.eval_every or (5 if args.task == "cot" else 100)  # lookup trains to the end
    args.eval_from = args.eval_from if args.eval_from is not None else (250 if cot else 0)
    max_new_tokens = 128 if cot else 32  # cot answers are ~65 tokens, arith's ~14

    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    splits = split_problems(args)
    problems = [p for rows in splits.values() for p in rows]
    test, valid, train, sft = splits["test"], splits["valid"], splits["train"], splits["sft"]
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    # cot's 20,000 warm-up problems are not written: the seed regenerates them.
    for name, rows in (("train", train), ("test", test)) + ((("sft", sft),) if not cot else ()):
        with (data / f"{name}.jsonl").open("w") as f:
            for p in rows:
                f.write(json.dumps({k: p[k] for k in ("id", "prompt", "answer")}) + "\n")

    out = Path(args.out)
    corpus = [CHAT_TEMPLATE] + [f"user\n{p['prompt']}{PROMPT_SUFFIX}\nassistant\n{p['solution']}" for p in problems]
    tokenizer = build_tokenizer(corpus, args.vocab, out)
    model = tiny_qwen2(tokenizer, args.hidden, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    # Linear warm-up, then cosine decay to 10 %; gradients clipped at norm 1.
    optim = OptimConfig(lr=args.lr, weight_decay=0.01, betas=[0.9, 0.98], warmup_steps=min(100, max(args.steps // 10, 1)),
                        schedule="cosine", min_lr_ratio=0.1, max_grad_norm=1.0)
    learner = Learner(ModelConfig(path=str(out)), LearnerConfig(backend="torch", device="cpu", dtype="float32"), optim,
                      LossConfig(), total_steps=args.steps, model=model)
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; "
          f"{len(sft)} sft / {len(train)} train / {len(test)} test problems, task {args.task}", flush=True)
    examples = {p["id"]: sft_example(tokenizer, p) for p in sft}
    first_loss = last_loss = float("nan")
    t0 = time.monotonic()
    for step in range(args.steps):
        model.train()
        batch = rng.sample(sft, args.batch)
        last_loss = sft_step(learner, [examples[p["id"]] for p in batch])["sft/loss"]
        if step == 0:
            first_loss = last_loss
        done = step == args.steps - 1
        if ((step + 1) % args.eval_every == 0 and step + 1 >= args.eval_from) or done:
            model.eval()
            # cot stops on greedy accuracy: the RL bench's start is measured greedily.
            val = evaluate(model, tokenizer, valid[: args.val_problems], samples=0 if cot else 4, seed=args.seed,
                           max_new_tokens=max_new_tokens)
            print(f"step {step + 1:5d}/{args.steps}  loss {last_loss:.3f}  lr {learner.current_lr():.1e}  "
                  f"val {'greedy' if cot else 'sampled'} acc {val['acc']:.2f} format {val['format']:.2f}  "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            if val["acc"] >= args.target_acc:
                print(f"reached --target-acc {args.target_acc}: stopping at step {step + 1}", flush=True)
                break
    print(f"loss: first {first_loss:.3f} last {last_loss:.3f}", flush=True)

    save_model(model, tokenizer, out)
    evaluated = test[: args.eval_problems]
    sampled = evaluate(model, tokenizer, evaluated, samples=args.eval_samples, seed=args.seed + 1,
                       max_new_tokens=max_new_tokens)
    greedy = evaluate(model, tokenizer, evaluated, samples=0, seed=args.seed, max_new_tokens=max_new_tokens)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"{len(evaluated)} test problems: sampled (T=1, {args.eval_samples} each) acc {sampled['acc']:.3f} "
          f"format {sampled['format']:.3f} answer tokens mean {sampled['mean_len']:.1f} max {sampled['max_len']}; "
          f"greedy acc {greedy['acc']:.3f} format {greedy['format']:.3f}")
    print(f"saved {out} ({size:.1f} MiB) and {data}")
    print(f"RESULT sampled_acc={sampled['acc']:.3f} greedy_acc={greedy['acc']:.3f} params={n_params} "
          f"build_s={time.monotonic() - t_start:.0f}", flush=True)


if __name__ == "__main__":
    main()
