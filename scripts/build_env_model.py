"""Build the environment adapters' tiny model: one small Qwen2 that plays the adapter configs' tasks.

    python scripts/build_env_model.py                          # -> models/tiny-env, data/env
    python scripts/build_env_model.py --steps 40 --out /tmp/env-model --data /tmp/env-data

Needs every adapter's package (``pip install -e '.[envs]'``): the warm-up conversations are
played against the real environments, through arbor's adapters, and rendered exactly as
``arbor train`` renders their episodes (``arbor.data.chat_template_ids`` with the
environment's ``tools`` for the prompt, the model's turn as its own ids + EOS, what the
environment answers as ``continuation_ids``). Five tasks, one model:

- ``guess``: TextArena's GuessTheNumber (configs/env_textarena.yaml): moves ``[N]`` that
  halve the range the hints leave, one move in four a random number in 1..20.
- ``keypad``: envs/keypad_openenv.py through OpenEnv (configs/env_openenv.yaml): two-digit guesses.
- ``sums``: reasoning-gym's chain_sum, one-digit terms (configs/env_reasoning_gym.yaml): the
  answer in reasoning-gym's ``<answer>...</answer>``, off by one or two in a third of them.
- ``lookup``: envs/lookup_tools.py's ``lookup`` tool, once as an MCP server's tool
  (configs/env_mcp.yaml) and once as a verifiers ToolEnv's (configs/env_verifiers.yaml):
  ``<tool_call>{"name": "lookup", "arguments": {"key": "k3"}}</tool_call>``, then the
  tool's answer boxed; one call in three names a wrong key, so the reward has room to rise.

No download: the tokenizer is models/tiny-arith's (byte-level, any text encodes); the chat
template is this script's (``CHAT_TEMPLATE``: ChatML turns, and with ``tools`` a system turn
listing them as JSON and saying how to call one, as Qwen2.5's does); the weights start
random (~0.9M parameters, 1,024 positions) and are supervised on the model's turns only.
Writes the model directory and the problem files the configs train on (seeds and keys the
warm-up never played). The last line printed is ``RESULT steps=... loss=... params=... build_s=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "envs"))

from arbor.data import chat_template_ids  # noqa: E402
from arbor.rollout.agents import continuation_ids  # noqa: E402

BASE = REPO / "models" / "tiny-arith"  # its tokenizer
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "Tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call a tool as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{%- endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAIN_SEEDS = range(64)  # the configs' problems (guess, keypad); the warm-up plays seeds from 1000
Episode = tuple[list[int], list[int]]  # (token ids, loss mask: 1 on the model's own tokens)


class Renderer:
    """Episodes as ``arbor train`` samples them: prompt, model turns, environment turns."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id

    def episode(self, start: list[dict], tools: list[dict], turns: list[tuple[str, list[dict]]]) -> Episode:
        """``turns``: (the model's text, the environment's answer messages; [] after the last)."""
        ids = chat_template_ids(self.tokenizer, start, generation_prompt=True, tools=tools)
        mask = [0] * len(ids)
        for text, answer in turns:
            own = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
            ids, mask = ids + own, mask + [1] * len(own)
            if answer:
                more = continuation_ids(self.tokenizer, answer)
                ids, mask = ids + more, mask + [0] * len(more)
        return ids, mask


def guess_episodes(render: Renderer, rng: random.Random, n: int) -> list[Episode]:
    from arbor.rollout.adapters.textarena import TextArenaGame

    out = []
    for k in range(n):
        game = TextArenaGame("GuessTheNumber-v0-raw")
        start = game.reset({}, seed=1000 + k)
        low, high, turns = 1, 20, []
        for _ in range(10):
            move = rng.randint(1, 20) if rng.random() < 0.25 else (low + high) // 2
            step = game.step([{"role": "assistant", "content": f"[{move}]"}])
            hint = step.messages[0]["content"]
            if "higher" in hint:
                low = max(low, move + 1)
            elif "lower" in hint:
                high = min(high, move - 1)
            turns.append((f"[{move}]", [] if step.done else step.messages))
            if step.done:
                break
        out.append(render.episode(start, [], turns))
    return out


def keypad_episodes(render: Renderer, rng: random.Random, n: int) -> list[Episode]:
    from keypad_openenv import Guess, Keypad

    out = []
    for k in range(n):
        keypad = Keypad()
        start = [{"role": "user", "content": keypad.reset(seed=1000 + k).feedback}]  # what OpenEnvClient.reset gives
        turns = []
        for _ in range(keypad.max_guesses):
            guess = f"{rng.randrange(100):02d}"
            feedback = keypad.step(Guess(guess=guess))
            turns.append((guess, [] if feedback.done else [{"role": "user", "content": feedback.feedback}]))
            if feedback.done:
                break
        out.append(render.episode(start, [], turns))
    return out


SUMS = "reasoning_gym:chain_sum?size={size}&seed={seed}&min_terms=2&max_terms=2&min_digits=1&max_digits=1"
SUMS_SYSTEM = "Give only the final answer, as <answer>answer here</answer>."


def sum_episodes(render: Renderer, rng: random.Random, n: int) -> list[Episode]:
    from arbor.config import DataConfig
    from arbor.data import load_problems

    out = []
    for problem in load_problems(SUMS.format(size=n, seed=1000), DataConfig()):
        answer = int(problem["answer"])
        if rng.random() < 1 / 3:
            answer += rng.choice([-2, -1, 1, 2])
        start = [{"role": "system", "content": SUMS_SYSTEM}, {"role": "user", "content": problem["prompt"]}]
        out.append(render.episode(start, [], [(f"<answer>{answer}</answer>", [])]))
    return out


def lookup_episodes(render: Renderer, rng: random.Random, n: int) -> list[Episode]:
    """Half with the MCP server's listing of the tool, half with the verifiers ToolEnv's."""
    from lookup_tools import TABLE, lookup, questions

    from arbor.rollout.adapters.mcp import MCPTools
    from arbor.rollout.adapters.verifiers import VerifiersEnv

    server = MCPTools([sys.executable, str(REPO / "envs" / "lookup_tools.py")])
    server.reset({"prompt": "."}, 0)
    verifiers_env = VerifiersEnv(str(REPO / "envs" / "lookup_tools.py") + ":load_environment")

    async def verifiers_tools() -> list[dict]:
        await verifiers_env.reset({"prompt": "."}, 0)
        await verifiers_env.close()
        return verifiers_env.tools

    listings = [server.tools, asyncio.run(verifiers_tools())]
    server.close()
    out = []
    for k in range(n):
        problem = questions()[k % len(TABLE)]
        key = problem["id"] if rng.random() > 1 / 3 else rng.choice(sorted(TABLE))
        call = f'<tool_call>{json.dumps({"name": "lookup", "arguments": {"key": key}})}</tool_call>'
        answer = [{"role": "tool", "content": lookup(key)}]
        turns = [(call, answer), (f"\\boxed{{{lookup(key)}}}", [])]
        out.append(render.episode([{"role": "user", "content": problem["prompt"]}], listings[k % 2], turns))
    return out


def write_problems(data: Path) -> None:
    from lookup_tools import load_environment, questions

    data.mkdir(parents=True, exist_ok=True)
    rows = {"guess.jsonl": [{"id": f"guess-{s}", "prompt": "", "answer": "", "seed": s} for s in TRAIN_SEEDS],
            "keypad.jsonl": [{"id": f"keypad-{s}", "prompt": "", "answer": "", "seed": s} for s in TRAIN_SEEDS],
            "lookup.jsonl": questions(),
            # The verifiers environment's own dataset rows (prompt messages, answer, example_id).
            "lookup_verifiers.jsonl": [{"id": f"k{r['example_id']}", **r}
                                       for r in load_environment().get_dataset().to_list()]}
    for name, items in rows.items():
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in items))


def train(episodes: list[Episode], tokenizer: Any, steps: int, batch: int, lr: float, seed: int) -> tuple[Any, float]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    loss_value = float("nan")
    for step in range(1, steps + 1):
        chosen = [episodes[rng.randrange(len(episodes))] for _ in range(batch)]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in chosen])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in chosen], dtype=torch.float32)
        attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chosen])
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / 50)
        optimizer.step()
        loss_value = float(loss.detach())
        if step % 50 == 0 or step == steps:
            print(f"step {step}/{steps} loss {loss_value:.4f}", flush=True)
    return model, loss_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "models" / "tiny-env")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "env")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--episodes", type=int, default=200, help="warm-up episodes per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BASE / name, args.out / name)
    (args.out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    render, rng = Renderer(tokenizer), random.Random(args.seed)
    episodes = (guess_episodes(render, rng, args.episodes) + keypad_episodes(render, rng, args.episodes)
                + sum_episodes(render, rng, args.episodes) + lookup_episodes(render, rng, args.episodes))
    print(f"{len(episodes)} warm-up episodes, {max(len(i) for i, _ in episodes)} tokens at most", flush=True)
    model, loss = train(episodes, tokenizer, args.steps, args.batch, args.lr, args.seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out)
    write_problems(args.data)
    params = sum(p.numel() for p in model.parameters())
    print(f"RESULT steps={args.steps} loss={loss:.4f} params={params} build_s={time.time() - start:.0f}")


if __name__ == "__main__":
    main()
