"""arbor: RL post-training for LLMs whose rollouts are trees.

Shared prefixes are generated once (SGLang's radix cache), credited as a tree (TreePO
subgroup advantages) and trained once (tree packing with exact gradients).

The public API — what agents, reward functions and scripts build on — is importable from
here and listed in ``docs/api.md``; the modules behind it may move between releases::

    from arbor import RolloutTree, compute_advantages, pack_trees, load_config

The names load on first use (:func:`__getattr__`): ``import arbor`` alone costs nothing,
which the CLI and every Ray worker rely on (``arbor.train`` pulls in torch, ``SGLangClient``
aiohttp).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it. tests/test_import_graph.py reads this table as
# imports of ``arbor``, so the layering and cycle checks see these edges.
_EXPORTS: dict[str, str] = {
    # the rollout tree
    "RolloutTree": "arbor.tree",
    "Node": "arbor.tree",
    "TreeStats": "arbor.tree",
    # config: the sections, the loader, the error every bad key raises
    "Config": "arbor.config",
    "ModelConfig": "arbor.config",
    "DataConfig": "arbor.config",
    "RolloutConfig": "arbor.config",
    "EngineConfig": "arbor.config",
    "RewardConfig": "arbor.config",
    "RewardTermConfig": "arbor.config",
    "AlgorithmConfig": "arbor.config",
    "LossConfig": "arbor.config",
    "OptimConfig": "arbor.config",
    "LearnerConfig": "arbor.config",
    "RayConfig": "arbor.config",
    "SftConfig": "arbor.config",
    "EvalConfig": "arbor.config",
    "RunConfig": "arbor.config",
    "load_config": "arbor.config_load",
    "ConfigError": "arbor.errors",
    # problems and prompts
    "load_problems": "arbor.data",
    "prompt_messages": "arbor.data",
    # rollout: sampling, agents, tools, rewards
    "sample_trees": "arbor.rollout.sampler",
    "sample_trees_sync": "arbor.rollout.sampler",
    "SampleStats": "arbor.rollout.sample_stats",
    "Agent": "arbor.rollout.agents",
    "Message": "arbor.rollout.agents",
    "Env": "arbor.rollout.environments",
    "Step": "arbor.rollout.environments",
    # agent programs: what a program run is given (rollout.program)
    "ProgramContext": "arbor.rollout.programs",
    "sample_program_trees": "arbor.rollout.programs",
    # environment adapters (each needs its optional extra: pip install 'arbor[envs]')
    "reasoning_gym_score": "arbor.rollout.adapters.reasoning_gym",
    "reasoning_gym_score_boxed": "arbor.rollout.adapters.reasoning_gym",
    "TextArenaGame": "arbor.rollout.adapters.textarena",
    "MCPTools": "arbor.rollout.adapters.mcp",
    "VerifiersEnv": "arbor.rollout.adapters.verifiers",
    "OpenEnvClient": "arbor.rollout.adapters.openenv",
    "parse_tool_calls": "arbor.rollout.adapters.tool_calls",
    "ToolPool": "arbor.rollout.tools",
    "ToolResult": "arbor.rollout.tools",
    "RewardFn": "arbor.rollout.rewards",
    "RewardTerm": "arbor.rollout.rewards",
    "RewardPool": "arbor.rollout.rewards",
    "ScoreResult": "arbor.rollout.rewards",
    "RewardError": "arbor.rollout.rewards",
    "score_batch": "arbor.rollout.rewards",
    "in_reward_worker": "arbor.rollout.rewards",
    "final_boxes": "arbor.rollout.answers",
    "last_boxed": "arbor.rollout.answers",
    # training: advantages, packing, the loss
    "compute_advantages": "arbor.train.advantage",
    "pack_trees": "arbor.train.packing",
    "PackedBatch": "arbor.train.packing",
    "policy_loss": "arbor.train.packed_loss",
    "policy_backward": "arbor.train.packed_loss",
    # engines, and pushing weights to them
    "WeightSync": "arbor.run.weight_sync",
    "SamplingParams": "arbor.engines.types",
    "GenerateRequest": "arbor.engines.types",
    "GenerateOutput": "arbor.engines.types",
    "RolloutEngine": "arbor.engines.types",
    "SGLangClient": "arbor.engines.client",
    "EngineError": "arbor.engines.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` on first access and cache the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'arbor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # type checkers and IDEs see the names without the lazy table
    from arbor.config import (
        AlgorithmConfig,
        Config,
        DataConfig,
        EngineConfig,
        EvalConfig,
        LearnerConfig,
        LossConfig,
        ModelConfig,
        OptimConfig,
        RayConfig,
        RewardConfig,
        RewardTermConfig,
        RolloutConfig,
        RunConfig,
        SftConfig,
    )
    from arbor.config_load import load_config
    from arbor.data import load_problems, prompt_messages
    from arbor.engines.client import SGLangClient
    from arbor.engines.errors import EngineError
    from arbor.engines.types import GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams
    from arbor.errors import ConfigError
    from arbor.rollout.adapters.mcp import MCPTools
    from arbor.rollout.adapters.openenv import OpenEnvClient
    from arbor.rollout.adapters.reasoning_gym import reasoning_gym_score, reasoning_gym_score_boxed
    from arbor.rollout.adapters.textarena import TextArenaGame
    from arbor.rollout.adapters.tool_calls import parse_tool_calls
    from arbor.rollout.adapters.verifiers import VerifiersEnv
    from arbor.rollout.agents import Agent, Message
    from arbor.rollout.answers import final_boxes, last_boxed
    from arbor.rollout.environments import Env, Step
    from arbor.rollout.programs import ProgramContext, sample_program_trees
    from arbor.rollout.rewards import (
        RewardError,
        RewardFn,
        RewardPool,
        RewardTerm,
        ScoreResult,
        in_reward_worker,
        score_batch,
    )
    from arbor.rollout.sample_stats import SampleStats
    from arbor.rollout.sampler import sample_trees, sample_trees_sync
    from arbor.rollout.tools import ToolPool, ToolResult
    from arbor.run.weight_sync import WeightSync
    from arbor.train.advantage import compute_advantages
    from arbor.train.packed_loss import policy_backward, policy_loss
    from arbor.train.packing import PackedBatch, pack_trees
    from arbor.tree import Node, RolloutTree, TreeStats
