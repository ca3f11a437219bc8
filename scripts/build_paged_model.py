"""Build models/tiny-paged-lookup: a tiny model that opens a page of a book and reads it.

    python scripts/build_paged_model.py                    # -> models/tiny-paged-lookup, data/paged-lookup
    python scripts/build_paged_model.py --steps 50 --out /tmp/paged --data /tmp/paged-data

No download. The task is ``scripts/paged_lookup_task.py`` played through
``envs/paged_lookup.py:PagedLookup`` (``configs/paged_lookup.yaml``): the tokenizer and the
0.9M-parameter Qwen2 are ``scripts/build_tiny_model.py``'s recipe (a byte-level BPE trained
here, 4 layers of 128) with 512 positions, room for the question, one page and the answer
(~300 tokens). The warm-up supervises whole episodes made by the environment itself, as
``arbor sft`` conversations (loss on the assistant turns only; the page is context):

    user       The book has 4 pages; to read one, write "open page" and its number. Open page 3, ...
    assistant  open page 3
    tool       Page 3 of 4 / - a4 / - b7 / ... / - Z2           (env.step's answer, ~210 tokens)
    user       What is K + d? Put the answer in \\boxed{}.      (env.step's too)
    assistant  read K7, d2, 7+2=9 \\boxed{9}                    (each read slips with --corrupt)

``--questions`` (8) episodes on one page differ only from the question on: they are trained as
one tree (``arbor sft``'s tree packing), the page computed once for all of them, which makes a
warm-up step ~4x cheaper than eight separate episodes.

It trains all its ``--steps``: stopped while the model is still learning to read, RL has
nothing to reinforce. Each read of a warm-up answer takes the next line's value with
probability ``--corrupt`` (0.55), so the trained model reads the page but prefers the wrong
line: its episodes start mostly wrong and RL has room.

Every ``--eval-every`` steps it reports, on validation problems with their right episode
(teacher forcing, one forward pass): ``greedy`` the share whose every assistant token is the
model's argmax (exactly the episodes greedy decoding produces), ``read`` the probability of
the right value at the two reads and ``read+slip`` that of the right or the neighbour's (near
1 once the model reads the page at all). The last line printed is ``RESULT greedy_exact=...
read=... read_or_slip=... params=... build_s=...`` on the test problems.

models/tiny-paged-lookup is this script's default run: ``RESULT greedy_exact=0.280 read=0.543
read_or_slip=0.993 params=903808 build_s=5145`` (1 h 26 min on a 2-core machine shared with
other jobs). The reading forms between SFT steps 600 (read+slip 0.29) and 1,200 (0.89); the
sums follow by step 1,700 (validation greedy 0.21, then 0.21-0.32 to the end). A read that
is right 0.54 of the time with the neighbour's line at 0.45 is the warm-up's 45/55 slip plus
the 10% of neighbours holding the same digit.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from build_tiny_model import CHAT_TEMPLATE, build_tokenizer, save_model, tiny_qwen2  # noqa: E402
from paged_lookup_task import PAGES, make_problems, neighbour, open_call  # noqa: E402

from arbor.config import DataConfig, LearnerConfig, LossConfig, ModelConfig, OptimConfig  # noqa: E402
from arbor.run.sft import SftExample, encode_example, sft_step  # noqa: E402
from arbor.train.learner import Learner  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402
from envs.paged_lookup import KEYS, PagedLookup  # noqa: E402

# configs/paged_lookup.yaml's data section: episodes start with the environment's messages alone.
DATA_CFG = DataConfig(system_prompt=None)
MAX_POSITIONS = 512  # question ~45 tokens + configs/paged_lookup.yaml's response budget (288)
SPLITS = {"test": 200, "valid": 100, "train": 1000}  # each problem its own book
ROW_KEYS = ("id", "prompt", "answer", "page", "keys", "pages")  # what the data files hold


def episode(problem: dict, answer: str) -> list[dict]:
    """The conversation the warm-up teaches, the tool turn made by the environment itself."""
    env = PagedLookup()
    messages = env.reset(problem, seed=0)
    messages.append({"role": "assistant", "content": open_call(problem["page"])})
    step = env.step(messages)
    if step.done or [m["role"] for m in step.messages] != ["tool", "user"]:
        raise RuntimeError(f"{problem['id']}: the environment answered {step!r} to {open_call(problem['page'])!r}")
    messages += [*step.messages, {"role": "assistant", "content": answer}]
    if not env.step(messages).done:
        raise RuntimeError(f"{problem['id']}: the environment did not end the episode after the answer")
    return messages


def right_answer(problem: dict) -> str:
    """The solution with no slip (``paged_lookup_task.solve`` without ``misread``)."""
    from paged_lookup_task import solve

    return solve(problem["pages"][problem["page"] - 1], problem["keys"])


def encode(tokenizer: Any, problem: dict, messages: list[dict]) -> SftExample:
    """The episode as ``arbor sft`` trains a conversation: assistant turns up to their EOS."""
    return encode_example({"messages": messages}, problem["id"], tokenizer, DATA_CFG, chat_template=True,
                          max_tokens=MAX_POSITIONS, stop_ids=[tokenizer.eos_token_id])


def page_tree(examples: Sequence[SftExample]) -> SftExample:
    """Episodes of one book and page as one tree: their common prefix (the question up to the
    page and the question's first words) once, then each episode's rest as a leaf."""
    first = examples[0].tree
    sequences = [(e.tree.response_ids(leaf), leaf.loss_mask) for e in examples for leaf in e.tree.leaves()]
    if any(e.tree.prompt_ids != first.prompt_ids for e in examples):
        raise ValueError(f"{examples[0].where}: the episodes of one tree start with different prompts")
    shared = 0  # tokens (and masks) every episode has in common, each leaf keeping one at least
    while (shared < min(len(ids) for ids, _ in sequences) - 1
           and len({(ids[shared], mask[shared]) for ids, mask in sequences}) == 1):
        shared += 1
    tree = RolloutTree(first.prompt_ids, problem={"id": examples[0].where})
    page = tree.add_segment(tree.root, sequences[0][0][:shared], loss_mask=sequences[0][1][:shared])
    for ids, mask in sequences:
        tree.add_segment(page, ids[shared:], loss_mask=mask[shared:])
    return SftExample(tree, [1.0] * len(sequences), examples[0].where)


def check_tokenizer(tokenizer: Any) -> None:
    """Each key one token after a space (question, page and answer alike), each digit one token."""
    several = [k for k in KEYS if len(tokenizer(f" {k}", add_special_tokens=False)["input_ids"]) != 1]
    if several or tokenizer.tokenize("0123456789") != list("0123456789"):
        raise RuntimeError(f"the tokenizer splits keys {several} or digits: raise --vocab")


@torch.no_grad()
def teacher_forced(model: Any, tokenizer: Any, problems: Sequence[dict]) -> dict[str, float]:
    """Greedy exact match and read probabilities on the problems' right episodes (see the
    module docstring), from one forward pass each."""
    greedy = read = read_or_slip = 0.0
    for problem in problems:
        example = encode(tokenizer, problem, episode(problem, right_answer(problem)))
        (leaf,) = example.tree.leaves()  # one node: the episode after its first message
        response = example.tree.response_ids(leaf)
        ids = torch.tensor([example.tree.prompt_ids + response])
        mask = torch.tensor(leaf.loss_mask)
        logits = model(input_ids=ids).logits[0, len(example.tree.prompt_ids) - 1:-1].float()
        target = torch.tensor(response)
        trained = mask.bool()
        greedy += bool((logits.argmax(-1)[trained] == target[trained]).all())
        probs = torch.softmax(logits, -1)
        # The reads: the value token right after each asked key's last occurrence (in the answer).
        for key in problem["keys"]:
            key_id = tokenizer(f" {key}", add_special_tokens=False)["input_ids"][0]
            at = len(response) - response[::-1].index(key_id)
            page = problem["pages"][problem["page"] - 1]
            right = tokenizer.convert_tokens_to_ids(page[KEYS.index(key)])
            slip = tokenizer.convert_tokens_to_ids(page[KEYS.index(neighbour(key))])
            read += float(probs[at, right]) / 2
            read_or_slip += float(probs[at, right] + (probs[at, slip] if slip != right else 0.0)) / 2
    n = len(problems)
    return {"greedy": greedy / n, "read": read / n, "read_or_slip": read_or_slip / n}


def describe(m: dict[str, float]) -> str:
    return f"greedy {m['greedy']:.2f} read {m['read']:.2f} read+slip {m['read_or_slip']:.2f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "models" / "tiny-paged-lookup"))
    parser.add_argument("--data", default=str(REPO / "data" / "paged-lookup"))
    parser.add_argument("--steps", type=int, default=3000, help="SFT steps (all of them are run)")
    parser.add_argument("--corrupt", type=float, default=0.55, help="chance that each read takes the next line's value")
    parser.add_argument("--eval-every", type=int, default=100, help="SFT steps between validation reports")
    parser.add_argument("--val-problems", type=int, default=100)
    parser.add_argument("--eval-problems", type=int, default=200, help="test problems for the final report")
    parser.add_argument("--sft-problems", type=int, default=20000, help="warm-up episodes")
    parser.add_argument("--questions", type=int, default=8, help="warm-up episodes per book and page (one tree)")
    parser.add_argument("--batch", type=int, default=4, help="trees per SFT step (--questions episodes each)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    counts = {**SPLITS, "valid": args.val_problems}
    problems = make_problems(args.seed, sum(counts.values()), args.corrupt)
    splits, start = {}, 0
    for name, count in counts.items():
        splits[name], start = problems[start:start + count], start + count
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    for name in ("train", "test"):  # the warm-up's problems are not written: the seed regenerates them
        with (data / f"{name}.jsonl").open("w") as f:
            for p in splits[name]:
                f.write(json.dumps({k: p[k] for k in ROW_KEYS}) + "\n")

    out = Path(args.out)
    # Its own seed: books the test, validation and RL problems never share.
    sft = make_problems(args.seed + 1, args.sft_problems, args.corrupt, questions=args.questions)
    warm_up = {p["id"]: episode(p, p["solution"]) for p in sft}
    corpus = [CHAT_TEMPLATE] + ["\n".join(f"{m['role']}\n{m['content']}" for m in warm_up[p["id"]]) for p in sft]
    tokenizer = build_tokenizer(corpus, args.vocab, out)
    check_tokenizer(tokenizer)
    model = tiny_qwen2(tokenizer, args.hidden, args.layers, MAX_POSITIONS)
    n_params = sum(p.numel() for p in model.parameters())
    # build_tiny_model's schedule: linear warm-up, cosine decay to 10 %, gradients clipped at 1.
    optim = OptimConfig(lr=args.lr, weight_decay=0.01, betas=[0.9, 0.98], warmup_steps=min(100, max(args.steps // 10, 1)),
                        schedule="cosine", min_lr_ratio=0.1, max_grad_norm=1.0)
    learner = Learner(ModelConfig(path=str(out)), LearnerConfig(backend="torch", device="cpu", dtype="float32"), optim,
                      LossConfig(), total_steps=args.steps, model=model)
    episodes = [encode(tokenizer, p, warm_up[p["id"]]) for p in sft]
    longest = max(len(e.tree.prompt_ids) + e.tree.leaves()[0].end for e in episodes)
    examples = [page_tree(episodes[i:i + args.questions]) for i in range(0, len(episodes), args.questions)]
    tokens = sum(len(e.tree.prompt_ids) + sum(len(n.token_ids) for n in e.tree.nodes()) for e in examples)
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; {len(sft)} warm-up episodes "
          f"({longest} tokens at most) in {len(examples)} trees ({tokens / len(examples):.0f} tokens each), "
          f"{len(splits['train'])} train / {len(splits['test'])} test problems, {PAGES} pages a book", flush=True)
    valid = splits["valid"]
    first_loss = last_loss = float("nan")
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        model.train()
        last_loss = sft_step(learner, rng.sample(examples, args.batch))["sft/loss"]
        first_loss = last_loss if step == 1 else first_loss
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            print(f"step {step:5d}/{args.steps}  loss {last_loss:.3f}  lr {learner.current_lr():.1e}  "
                  f"val {describe(teacher_forced(model, tokenizer, valid))}  {time.monotonic() - t0:.0f} s", flush=True)
    print(f"loss: first {first_loss:.3f} last {last_loss:.3f}", flush=True)

    save_model(model, tokenizer, out)
    test = teacher_forced(model, tokenizer, splits["test"][: args.eval_problems])
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"{min(args.eval_problems, len(splits['test']))} test problems: {describe(test)}")
    print(f"saved {out} ({size:.1f} MiB) and {data}")
    print(f"RESULT greedy_exact={test['greedy']:.3f} read={test['read']:.3f} read_or_slip={test['read_or_slip']:.3f} "
          f"params={n_params} build_s={time.monotonic() - t_start:.0f}", flush=True)


if __name__ == "__main__":
    main()
