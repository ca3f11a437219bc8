"""Write ``docs/api.md``: every name of ``arbor.__all__`` with its meaning and signature.

    python scripts/api_docs.py            # rewrite docs/api.md
    python scripts/api_docs.py --check    # exit 1 if docs/api.md is stale (tests/test_public_api.py)

The meanings are written here, one line per name (a name without one stops the script);
the signatures are read from the code, so a changed signature shows up as a stale page.
Config sections list no fields: their keys are the config reference's (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

import arbor

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# Section title -> (name -> one-line meaning), in the page's order.
MEANINGS: dict[str, dict[str, str]] = {
    "Rollout trees": {
        "RolloutTree": "The rollouts of one prompt as a tree of token segments; leaves carry rewards.",
        "Node": "One segment of a tree: its tokens, behaviour log-probs, loss mask, parent and children.",
        "TreeStats": "Token accounting of a tree (unique vs linearised tokens, leaves, depth).",
    },
    "Configuration": {
        "load_config": "Read a YAML config, apply `section.key=value` overrides, validate; errors name key and file:line.",
        "ConfigError": "Raised for a bad config value; the message names the key and, where known, the file.",
        "Config": "The whole run configuration: one field per section below.",
        "ModelConfig": "`model:` the policy checkpoint, dtype, chat template.",
        "DataConfig": "`data:` problem files, prompt columns, prompts per step.",
        "RolloutConfig": "`rollout:` TreePO sampling (width, branch, segment tokens, depth), the agent or environment.",
        "EngineConfig": "`engine:` which inference servers, how many, their timeouts and key.",
        "RewardConfig": "`reward:` the reward functions, their workers and timeout.",
        "RewardTermConfig": "One weighted reward function of `reward.functions` (`module:attr` or `file.py:attr`).",
        "AlgorithmConfig": "`algorithm:` the advantage estimator, dynamic sampling, epochs, staleness.",
        "LossConfig": "`loss:` clip range, normalisation, KL and entropy terms.",
        "OptimConfig": "`optim:` learning rate, schedule, AdamW settings, gradient clipping.",
        "LearnerConfig": "`learner:` backend, ZeRO stage, ranks, device, packing budget, weight sync.",
        "RayConfig": "`ray:` cluster address, resources, colocation, placement.",
        "SftConfig": "`sft:` supervised fine-tuning data and batch size (`arbor sft`).",
        "EvalConfig": "`eval:` the evaluation set and its sampling (`arbor eval`, periodic evals).",
        "RunConfig": "`run:` name, output directory, steps, logging, checkpoints, resume.",
    },
    "Problems and prompts": {
        "load_problems": "Read a problem file (jsonl, parquet, ...) into dicts with `id`, `prompt`, `answer`.",
        "prompt_messages": "A problem's prompt (text or chat messages) as chat messages, with suffix and system prompt.",
    },
    "Sampling": {
        "sample_trees": "Sample one rollout tree per prompt from an engine, concurrently (TreePO or independent).",
        "sample_trees_sync": "`sample_trees` from synchronous code.",
        "SampleStats": "What sampling one tree cost (requests, tokens, cache hits) and why it stopped short.",
    },
    "Agents, environments and tools": {
        "Agent": "The agent protocol: `start(problem)` gives the first messages, `step(problem, history)` the next.",
        "Message": "A chat message an agent or environment returns (`role`, `content`, optional `error`).",
        "Env": "The environment protocol: `reset(problem, seed)`, `step(history) -> Step`, `reward()`, `fork`, `copy()`, `close()` (docs/environments.md).",
        "Step": "What an environment answers after a model turn: `Step(messages, done=False)`.",
        "ProgramContext": "What an agent program run is given: `base_url`, `api_key`, `model`, `seed`, `openai_client()` (docs/agent-programs.md).",
        "sample_program_trees": "One tree per problem from `rollout.width` runs of an agent program, forked by replay.",
        "ToolPool": "Runs sandboxed tool calls (Python) concurrently with time, memory and output limits.",
        "ToolResult": "The outcome of one tool call: output, time, and why it failed if it did.",
    },
    "Environment adapters": {
        "reasoning_gym_score": "Reward: a `reasoning_gym:NAME` problem's dataset scores the completion's last `<answer>` (docs/env-adapters.md).",
        "reasoning_gym_score_boxed": "Reward: the same, for the completion's last `\\boxed{}`.",
        "TextArenaGame": "A TextArena single-player game per episode, forked by copy with its random state (`arbor[textarena]`).",
        "MCPTools": "The tools of a stdio MCP server, called by the environment; forks replay side effects (`arbor[mcp]`).",
        "VerifiersEnv": "A verifiers MultiTurnEnv/ToolEnv rollout with arbor as its client, its rubric the reward (`arbor[verifiers]`).",
        "OpenEnvClient": "An OpenEnv server driven through its client, a WebSocket connection per branch, forked by replay (`arbor[openenv]`).",
        "parse_tool_calls": "The Hermes `<tool_call>{...}</tool_call>` calls in a model's text, for adapters of your own.",
    },
    "Rewards": {
        "RewardFn": "The reward protocol: `fn(problem, completion) -> float`.",
        "RewardTerm": "A reward function spec with its weight.",
        "RewardPool": "Worker processes that score (problem, completion) pairs with timeouts.",
        "ScoreResult": "Scores of a batch with per-term scores, timeouts and crashes.",
        "RewardError": "A reward function raised or returned a non-number; names the problem.",
        "score_batch": "Score a batch once with a fresh `RewardPool`.",
        "in_reward_worker": "True inside a reward worker process (for warming caches at import).",
        "final_boxes": "The contents of a completion's final run of `\\boxed{}` answers.",
        "last_boxed": "The content of a completion's last `\\boxed{}`.",
    },
    "Training": {
        "compute_advantages": "Per-leaf (or per-token) advantages of a batch of trees by the named estimator.",
        "pack_trees": "Pack trees into token-budgeted batches, each shared prefix once, with exact loss weights.",
        "PackedBatch": "One forward/backward of packed tree tokens with the attention structure and loss columns.",
        "policy_loss": "The clipped policy loss of trees under a model (tree-packed, linear or padded).",
        "policy_backward": "The policy loss and its gradients, each pack at once or walked depth first (dfs).",
        "WeightSync": "Pushes weights to every engine: a torch.distributed broadcast, an HF directory or a LoRA adapter.",
    },
    "Engines": {
        "SamplingParams": "Sampling settings of one request (tokens, temperature, top-p/k, n, stop ids, seed).",
        "GenerateRequest": "One generation request in token ids, with its sampling and cache-affinity key.",
        "GenerateOutput": "One continuation: token ids, behaviour log-probs, finish reason, cache use, weight version.",
        "RolloutEngine": "The engine protocol the sampler needs: `async generate(request) -> list[GenerateOutput]`.",
        "SGLangClient": "HTTP client for SGLang-compatible servers (SGLang or `arbor serve`): generate, weights, cache.",
        "EngineError": "A request an engine refused or that kept failing after retries.",
    },
}

CONFIG_SECTIONS = {name for name in MEANINGS["Configuration"] if name.endswith("Config")}


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, typing.ForwardRef):  # a TypedDict's keys under `from __future__ import annotations`
        return annotation.__forward_arg__
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _parameters(signature: inspect.Signature) -> str:
    parts: list[str] = []
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in parts):
            parts.append("*")
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += ": " + _annotation(p.annotation)
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + repr(p.default)
        parts.append(text)
    return ", ".join(parts)


def _returns(signature: inspect.Signature) -> str:
    ret = signature.return_annotation
    return "" if ret is signature.empty or ret in (None, "None") else " -> " + _annotation(ret)


def signature(name: str, obj: Any) -> str:
    """How ``name`` is called, as Python: a function's ``def``, a class's constructor,
    a protocol's methods, a typed dict's keys."""
    if inspect.isfunction(obj):
        prefix = "async def" if inspect.iscoroutinefunction(obj) else "def"
        sig = inspect.signature(obj)
        return f"{prefix} {name}({_parameters(sig)}){_returns(sig)}"
    if name in CONFIG_SECTIONS:
        return f"class {name}(...)  # the section's keys: docs/configuration.md"
    if getattr(obj, "_is_protocol", False):
        methods = [m for m in obj.__dict__ if not m.startswith("_") or m == "__call__"]
        lines = [f"class {name}(Protocol):"]
        for m in methods:
            fn = obj.__dict__[m]
            if not callable(fn):  # a class attribute with its default (Env.fork)
                lines.append(f"    {m}: {_annotation(obj.__annotations__.get(m, type(fn).__name__))} = {fn!r}")
                continue
            sig = inspect.signature(fn)
            lines.append(f"    {'async def' if inspect.iscoroutinefunction(fn) else 'def'} {m}({_parameters(sig)}){_returns(sig)}")
        return "\n".join(lines)
    if typing.is_typeddict(obj):
        return "\n".join([f"class {name}(TypedDict):"] + [f"    {k}: {_annotation(v)}" for k, v in obj.__annotations__.items()])
    if dataclasses.is_dataclass(obj) or "__init__" in obj.__dict__:
        return f"class {name}({_parameters(inspect.signature(obj))})"
    base = obj.__mro__[1].__name__
    return f"class {name}({base})"


def page() -> str:
    exported = set(arbor.__all__) - {"__version__"}
    described = {name for names in MEANINGS.values() for name in names}
    if exported != described:
        sys.exit(f"scripts/api_docs.py: MEANINGS and arbor.__all__ differ: missing {sorted(exported - described)}, "
                 f"not exported {sorted(described - exported)}")
    out = [
        "# Public API",
        "",
        "What agents, reward functions and scripts build on, importable from `arbor` itself:",
        "",
        "```python",
        "from arbor import RolloutTree, load_config, sample_trees, compute_advantages, pack_trees, policy_loss",
        "```",
        "",
        "These names keep their meaning across releases; the modules behind them (`arbor.rollout`,",
        "`arbor.train`, `arbor.run`, `arbor.engines`) may move. `import arbor` is cheap: each name",
        "loads its module on first use. This page is generated by `python scripts/api_docs.py`.",
    ]
    for title, names in MEANINGS.items():
        out += ["", f"## {title}"]
        for name, meaning in names.items():
            out += ["", f"### `{name}`", "", meaning, "", "```python", signature(name, getattr(arbor, name)), "```"]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from what would be written")
    args = parser.parse_args()
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python scripts/api_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
