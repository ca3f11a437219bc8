"""Build the agent quickstart's model: models/tiny-arith taught to use the Python tool.

    python scripts/build_tool_model.py                 # -> models/tiny-arith-tool, data/arith-tool
    python scripts/build_tool_model.py --steps 20 --out /tmp/tool --data /tmp/arith-tool

No download: it starts from ``models/tiny-arith`` (``scripts/build_tiny_model.py``: its
tokenizer unchanged, its weights warm-started further) and supervises conversations in
exactly the format ``arbor train`` gives ``agents/python_tool.py:PythonTool`` episodes
(``configs/agent_math.yaml``: no system prompt, the agent's ``start``, chat-templated):

    user       What is 37+48? + the agent's instruction to write a ```python block
    assistant  ```python\\nprint(37+48)\\n```
    tool       85                                   (the real sandbox output, agent.step)
    assistant  \\boxed{85}                           (no code block: the episode ends)

written as ``arbor sft`` conversations (``{"messages": [...]}``, ``data/arith-tool/sft.jsonl``)
and trained by ``arbor sft``'s step on a plain-torch learner: the loss is on the two
assistant turns only, the prompt and the tool message are context, as in RL.

It stops early on purpose: RL needs a policy that calls the tool most of the time but
not always, and sometimes copies an operand wrong or writes code that fails (a tool
error), so reward and tool use can rise. Every ``--eval-every`` steps it samples
validation episodes as RL does (the sampler, the embedded engine, the agent and its
sandbox, temperature 1.0) and it ends at ``--steps``, or once ``--target-acc`` of them
are right and ``--target-tool-use`` call the tool (tool calls come first: ~0.9 of the
episodes call it while only ~0.05 copy the operands and the output right). The problems
are ``data/arith``'s SFT split (the first ``--val-problems`` for early stopping, the rest
trained on), so the RL train split and the test split stay unseen. The last line printed
is ``RESULT tool_use=... tool_errors=... sampled_acc=... greedy_acc=... params=... build_s=...``
(on the test split: the share of episodes with a tool call, tool errors per episode,
accuracy at temperature 1.0 and greedy).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.config import (  # noqa: E402
    DataConfig,
    LearnerConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
)
from arbor.data import read_rows  # noqa: E402
from arbor.engines.embedded.engine import LocalEngine  # noqa: E402
from arbor.rollout.agents import Agent, Message, episode_inputs, load_agent, tool_turns  # noqa: E402
from arbor.rollout.answers import last_boxed  # noqa: E402
from arbor.rollout.sampler import sample_trees_sync  # noqa: E402
from arbor.run.sft import SftExample, load_examples, sft_step  # noqa: E402
from arbor.train.learner import Learner  # noqa: E402

AGENT = "agents/python_tool.py:PythonTool"  # configs/agent_math.yaml's rollout.agent
# configs/agent_math.yaml's response budget (segment_tokens · max_depth): code, tool
# message and answer take ~60 tokens after a ~110-token prompt; the context is 256.
MAX_RESPONSE_TOKENS = 96
# configs/agent_math.yaml's data section: episodes start with the agent's messages alone.
DATA_CFG = DataConfig(system_prompt=None)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROBLEM = re.compile(r"What is (\d+[+-]\d+)\?")


def conversation(agent: Agent, problem: dict[str, str]) -> list[Message]:
    """The episode the warm-up teaches: code, the sandbox's real output, the boxed answer."""
    expression = PROBLEM.fullmatch(problem["prompt"]).group(1)
    messages = agent.start(problem)
    messages.append({"role": "assistant", "content": f"```python\nprint({expression})\n```"})
    tool = agent.step(problem, messages)
    if not tool or tool[0].get("error") or tool[0]["content"].strip() != problem["answer"]:
        raise RuntimeError(f"{problem['id']}: the sandbox answered {tool!r} to print({expression})")
    result = tool[0]["content"].strip()
    # The answer copies the tool's output. Restating the sum ("37+48=85 \\boxed{85}", the
    # base model's format) made the model compute it again itself, ignoring the tool.
    return [
        *messages,
        *({"role": m["role"], "content": m["content"]} for m in tool),
        {"role": "assistant", "content": f"\\boxed{{{result}}}"},
    ]


def write_conversations(agent: Agent, problems: Sequence[dict[str, str]], path: Path) -> None:
    """One ``arbor sft`` conversation line per problem (the sandbox calls two at a time)."""
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(functools.partial(conversation, agent), problems))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for problem, messages in zip(problems, rows):
            f.write(json.dumps({"id": problem["id"], "messages": messages}) + "\n")


def measure(
    engine: LocalEngine,
    tokenizer: Any,
    agent: Agent,
    problems: Sequence[dict[str, str]],
    samples: int,
    seed: int,
) -> dict[str, float]:
    """Episodes as ``arbor train`` samples them (``samples`` per problem, temperature 1.0;
    ``samples=0``: one greedy episode): the share with a tool call, tool calls and tool
    errors per episode, accuracy (the last boxed answer equals the gold one)."""
    prompts, render = episode_inputs(problems, agent, tokenizer, DATA_CFG, chat_template=True)
    cfg = RolloutConfig(
        mode="independent",
        width=max(samples, 1),
        segment_tokens=MAX_RESPONSE_TOKENS,
        max_depth=1,
        temperature=1.0 if samples else 0.0,
    )
    trees, stats = sample_trees_sync(
        engine,
        problems,
        prompts,
        cfg,
        eos_token_ids=[tokenizer.eos_token_id],
        seed=seed,
        agent=agent,
        decode=functools.partial(tokenizer.decode, skip_special_tokens=True),
        render=render,
    )
    episodes = used = calls = correct = 0
    for tree in trees:
        for leaf in tree.leaves():
            turns = tool_turns(tree, leaf)
            text = tokenizer.decode(tree.response_ids(leaf), skip_special_tokens=True)
            boxed = last_boxed(text)
            episodes, used, calls = episodes + 1, used + (turns > 0), calls + turns
            correct += boxed is not None and boxed.strip() == tree.problem["answer"]
    return {
        "tool_use": used / episodes,
        "tool_calls": calls / episodes,
        "tool_errors": sum(s.tool_errors for s in stats) / episodes,
        "acc": correct / episodes,
    }


def describe(m: dict[str, float]) -> str:
    return (
        f"tool use {m['tool_use']:.2f} (calls {m['tool_calls']:.2f}, errors {m['tool_errors']:.2f} "
        f"per episode) acc {m['acc']:.2f}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base", default=str(REPO / "models" / "tiny-arith"), help="the model warm-started further"
    )
    parser.add_argument("--problems", default=str(REPO / "data" / "arith" / "sft.jsonl"))
    parser.add_argument("--test", default=str(REPO / "data" / "arith" / "test.jsonl"))
    parser.add_argument("--out", default=str(REPO / "models" / "tiny-arith-tool"))
    parser.add_argument("--data", default=str(REPO / "data" / "arith-tool"))
    parser.add_argument("--steps", type=int, default=400, help="SFT steps at most")
    parser.add_argument(
        "--target-acc",
        type=float,
        default=0.4,
        help="stop once the sampled (T=1) validation accuracy reaches this ...",
    )
    parser.add_argument(
        "--target-tool-use",
        type=float,
        default=0.75,
        help="... and this share of the validation episodes calls the tool",
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--val-problems", type=int, default=100, help="validation problems for early stopping"
    )
    parser.add_argument(
        "--val-samples", type=int, default=4, help="episodes per validation problem at T=1"
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-problems", type=int, default=200, help="test problems for the final report"
    )
    parser.add_argument(
        "--eval-samples", type=int, default=4, help="episodes per test problem at T=1"
    )
    return parser.parse_args()


def warm_up(
    args: argparse.Namespace,
    model: Any,
    examples: list[SftExample],
    measure_valid: Callable[[], dict],
) -> None:
    """SFT steps on random batches of ``examples`` until ``--steps`` or both targets."""
    rng = random.Random(args.seed)
    # A constant rate after a short warm-up: the stop comes from the targets, not a schedule.
    optim = OptimConfig(
        lr=args.lr,
        weight_decay=0.01,
        betas=[0.9, 0.98],
        warmup_steps=min(10, args.steps),
        schedule="constant",
        max_grad_norm=1.0,
    )
    learner = Learner(
        ModelConfig(path=args.base),
        LearnerConfig(backend="torch", device="cpu", dtype="float32"),
        optim,
        LossConfig(),
        total_steps=args.steps,
        model=model,
    )
    print(f"step     0  val {describe(measure_valid())}", flush=True)
    first_loss = last_loss = float("nan")
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        model.train()
        last_loss = sft_step(learner, rng.sample(examples, args.batch))["sft/loss"]
        first_loss = last_loss if step == 1 else first_loss
        if step % args.eval_every and step < args.steps:
            continue
        model.eval()
        val = measure_valid()
        print(
            f"step {step:5d}/{args.steps}  loss {last_loss:.3f}  val {describe(val)}  "
            f"{time.monotonic() - t0:.0f} s",
            flush=True,
        )
        if val["acc"] >= args.target_acc and val["tool_use"] >= args.target_tool_use:
            print(
                f"reached --target-acc {args.target_acc} and --target-tool-use {args.target_tool_use}: "
                f"stopping at step {step}",
                flush=True,
            )
            break
    model.eval()
    print(f"loss: first {first_loss:.3f} last {last_loss:.3f}", flush=True)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args()
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    agent = load_agent(AGENT, "AGENT", [str(REPO)])
    problems = [row for _, row in read_rows(Path(args.problems))]
    valid, sft = problems[: args.val_problems], problems[args.val_problems :]
    test = [row for _, row in read_rows(Path(args.test))][: args.eval_problems]
    conversations = Path(args.data) / "sft.jsonl"
    write_conversations(agent, sft, conversations)

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    # What `arbor sft` loads from the file; every conversation must fit in the context.
    examples = load_examples(
        conversations,
        tokenizer,
        DATA_CFG,
        chat_template=True,
        max_tokens=model.config.max_position_embeddings,
    )
    longest = max(len(e.tree.prompt_ids) + e.tree.leaves()[0].end for e in examples)
    print(
        f"{args.base}: {n_params / 1e6:.2f}M parameters; {len(examples)} conversations ({longest} tokens "
        f"at most) in {conversations}, {len(valid)} validation problems",
        flush=True,
    )
    # Episodes run on the embedded engine, which gets the learner's weights before each check.
    engine = LocalEngine(args.base, max_cached_tokens=1 << 18, seed=args.seed)

    def episodes(problems: Sequence[dict[str, str]], samples: int, seed: int) -> dict[str, float]:
        engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()})
        return measure(engine, tokenizer, agent, problems, samples, seed)

    warm_up(args, model, examples, lambda: episodes(valid, args.val_samples, args.seed))
    out = Path(args.out)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # The base's tokenizer files as they are: save_pretrained would rewrite them as the class
    # transformers loads them with (Qwen2Tokenizer), a different file for other loaders.
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(args.base) / name, out / name)
    sampled = episodes(test, args.eval_samples, args.seed + 1)
    greedy = episodes(test, 0, args.seed)
    engine.shutdown()
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"{len(test)} test problems: sampled (T=1, {args.eval_samples} each) {describe(sampled)}; "
        f"greedy {describe(greedy)}"
    )
    print(f"saved {out} ({size:.1f} MiB) and {conversations}")
    print(
        f"RESULT tool_use={sampled['tool_use']:.3f} tool_errors={sampled['tool_errors']:.3f} "
        f"sampled_acc={sampled['acc']:.3f} greedy_acc={greedy['acc']:.3f} params={n_params} "
        f"build_s={time.monotonic() - t_start:.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
