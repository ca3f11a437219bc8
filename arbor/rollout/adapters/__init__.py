"""Adapters to environment libraries users already have (docs/env-adapters.md).

Each wraps a real package, installed as an optional extra (``pip install 'arbor[envs]'`` for all):

- :mod:`~arbor.rollout.adapters.reasoning_gym`: reasoning-gym's datasets as problems
  (``data.train_path: reasoning_gym:NAME``) and their own scorers as reward functions.
- :mod:`~arbor.rollout.adapters.textarena`: TextArena's single-player games as environments.
- :mod:`~arbor.rollout.adapters.mcp`: the tools of a stdio MCP server, called by the environment.
- :mod:`~arbor.rollout.adapters.verifiers`: a verifiers ``MultiTurnEnv`` / ``ToolEnv`` rollout,
  arbor sampling every model turn, the environment's rubric as the reward.
- :mod:`~arbor.rollout.adapters.openenv`: an OpenEnv environment server through its client.
"""
