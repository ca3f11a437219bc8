"""Short ``arbor train`` runs of the adapter configs, for tests/test_adapters_*.py.

    history, trees = train_steps(tmp_path, "configs/env_textarena.yaml", "rollout.width=4")
    # history: each step's metrics; trees: every tree the run saved ({step: [RolloutTree]})
    tree, stats = sample_a_tree("arbor.rollout.adapters.openenv:OpenEnvClient", args, problem)

Two RL steps on a few problems, on the plain-torch learner, every tree saved: enough to see
what the environment returned in the trees and the rewards, in minutes on two cores. One
tree through arbor's sampler with a scripted engine (seconds): the replay check at each fork.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from arbor.config_load import load_config
from arbor.rollout.environments import load_env
from arbor.rollout.episodes import EpisodeSetup
from arbor.rollout.sample_stats import SampleStats
from arbor.rollout.sampler import sample_trees
from arbor.run.trainer import train
from arbor.tree import Node, RolloutTree

REPO = Path(__file__).resolve().parents[1]


def train_steps(tmp_path: Path, config: str, *overrides: str) -> tuple[list[dict], dict[int, list[RolloutTree]]]:
    out = tmp_path / "run"
    cfg = load_config(REPO / config, [
        f"run.output_dir={out}", "run.steps=2", "run.eval_every=0", "run.save_every=0", "run.save_trees_every=1",
        "run.cpu_threads=1", "data.prompts_per_step=4", "learner.backend=torch", "learner.zero_stage=0",
        # Synchronous: these runs check what the adapters put in the trees, over 2 steps; an
        # asynchronous run is checked over max_staleness + 2 steps (tests/async_checks.py).
        "reward.workers=1", "algorithm.max_staleness=0", *overrides,
    ])
    history = train(cfg)
    trees = {int(p.stem.split("-")[1]): [RolloutTree.from_json(line) for line in p.read_text().splitlines()]
             for p in sorted((out / "trees").glob("step-*.jsonl"))}
    return history, trees


def sample_a_tree(spec: str, args: dict, problem: dict) -> tuple[RolloutTree, SampleStats]:
    """One tree of ``problem``, 8 leaves, sampled by arbor's sampler with ``rollout.env: spec``
    (``rollout.env_args: args``): tests/test_sampler.py's scripted engine writes each model turn
    as 2 seeded tokens and EOS (the text is the ids, "57 203"), tests/env_fixtures.py renders
    the environment's turns. Forks after an environment turn get their instance by replay, each
    replayed step compared with the recorded one (arbor.rollout.env_forks)."""
    from env_fixtures import render
    from test_sampler import EOS, PROMPT, ScriptedEngine, cfg_of, fresh

    engine = ScriptedEngine(8, lambda request, j, depth: (fresh(request, j, 2) + [EOS], "stop"))
    setup = EpisodeSetup(load_env(spec, kwargs=args), render, prompt=lambda messages, tools=None: list(PROMPT))
    (tree,), (stats,) = asyncio.run(sample_trees(
        engine, [problem], None, cfg_of(width=8, segment_tokens=8, max_depth=64), eos_token_ids=[EOS],
        decode=lambda ids: " ".join(map(str, ids)), env=setup, seed=5))
    return tree, stats


def check_replays(tree: RolloutTree, stats: SampleStats, diverge: bool) -> None:
    """Forks replayed the environment's turns; with ``diverge`` (a non-deterministic environment)
    the check caught each replay that differed: counted, the branch dropped, never sampled."""
    assert stats.env_forks.get("replay", 0) > 0 and stats.env_replayed_steps > 0, stats
    if not diverge:
        assert stats.env_errors == 0 and stats.env_dropped == 0 and len(tree.leaves()) == 8, stats
        return
    assert stats.env_errors > 0 and stats.env_dropped == stats.env_errors, stats
    assert stats.env_diverged == stats.env_errors and not stats.failures  # counted, not a code failure
    assert len(tree.leaves()) == 8 - stats.env_dropped and stats.shortfall_reason.startswith("environment failures")


def forks_after_a_turn(tree: RolloutTree, is_env_turn) -> int:
    """Nodes with two or more children below an environment turn: forks mid-episode."""
    def below_turn(node: Node) -> bool:
        return any(is_env_turn(n) for n in tree.path(node))

    return sum(1 for node in tree.nodes() if len(node.children) >= 2 and node.parent is not None and below_turn(node))


def env_turn(node: Node) -> bool:
    """A node the model sampled none of (loss mask all 0): an environment's answer."""
    return bool(node.loss_mask) and not any(node.loss_mask)


def model_turns(tree: RolloutTree, leaf: Node) -> list[tuple[list[int], list[int] | None]]:
    """The episode to ``leaf`` as ``[(a model turn's ids, the environment turn's ids after it
    or None), ...]``: what a replay of the same turns must reproduce."""
    turns: list[tuple[list[int], list[int] | None]] = []
    model: list[int] = []
    for node in tree.path(leaf):
        if node.parent is None:
            continue
        if env_turn(node):
            turns.append((model, node.token_ids))
            model = []
        else:
            model += node.token_ids
    if model:
        turns.append((model, None))
    return turns


def replay_leaf(make_env, tree: RolloutTree, leaf: Node, tokenizer, seed: int = 0) -> tuple[list[list[int]], float | None]:
    """Replay the episode to ``leaf`` on a fresh instance of the real environment: the ids of
    its answers, rendered as arbor renders them, and its reward. A final model turn that ended
    on the stop token was stepped too (the episode ended there because the environment said so)."""
    import asyncio
    import inspect

    from arbor.rollout.agents import continuation_ids

    async def run():
        async def call(fn, *args):
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result

        env = make_env()
        try:
            history = list(await call(env.reset, tree.problem, seed))
            rendered = []
            for ids, answer in model_turns(tree, leaf):
                stopped = bool(ids) and ids[-1] == tokenizer.eos_token_id
                if answer is None and not stopped:
                    break  # cut by the length budget: never stepped
                text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
                history.append({"role": "assistant", "content": text})
                step = await call(env.step, history)
                if answer is not None:
                    rendered.append(continuation_ids(tokenizer, step.messages))
                    history += step.messages
            reward = await call(env.reward) if hasattr(env, "reward") else None
            return rendered, reward
        finally:
            await call(env.close)

    return asyncio.run(run())


def check_episodes(trees: dict[int, list[RolloutTree]], make_env, tokenizer, reward_fn=None) -> tuple[int, int]:
    """Every leaf's episode replayed on the real environment: each environment turn in the tree
    is the ids of what the environment answered, and the leaf's reward is its ``reward()``
    (``reward.env_weight`` 1) plus ``reward_fn(problem, completion)``. Returns (environment
    turns checked, forks after an environment turn)."""
    import pytest

    turns = forks = 0
    for tree in (t for step in trees.values() for t in step):
        forks += forks_after_a_turn(tree, env_turn)
        for leaf in tree.leaves():
            if leaf.reward is None:  # dropped (a diverged replay, a timeout): never trained on
                continue
            rendered, env_reward = replay_leaf(make_env, tree, leaf, tokenizer)
            assert [n.token_ids for n in tree.path(leaf) if env_turn(n)] == rendered
            expected = env_reward or 0.0
            if reward_fn is not None:
                expected += reward_fn(tree.problem, tokenizer.decode(tree.response_ids(leaf), skip_special_tokens=True))
            assert leaf.reward == pytest.approx(expected), (tree.problem["id"], leaf.id)
            turns += len(rendered)
    return turns, forks
