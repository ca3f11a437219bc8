"""What sampling one tree cost: :class:`SampleStats` (requests, rounds, tokens, cache hits,
fallbacks, agent turns, environments) and why the tree has fewer than ``width`` leaves if so."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from arbor.errors import EpisodeFailure
from arbor.tree import Node


@dataclass
class SampleStats:
    """What sampling one tree cost, and why it has fewer than ``width`` leaves if so."""

    leaves: int = 0
    requests: int = 0  # paths sent (one request each; the rounds go out batched)
    rounds: int = 0
    tokens_generated: int = 0  # Σ output tokens
    prompt_tokens: int = 0  # Σ over outputs of their input length
    cached_tokens: int = 0  # Σ over outputs of input tokens served from the radix cache
    fallbacks: int = 0  # finished paths cut and restarted from (fallback sources)
    root_restarts: int = 0  # fallbacks from the root: no finished path was well-formed
    tool_turns: int = 0  # agent turns appended (multi-turn episodes)
    tool_errors: int = 0  # agent messages marked error=True (a tool timed out, raised, ...)
    agent_timeouts: int = 0  # agent.step calls past rollout.agent_timeout_s (episode ended)
    resampled: int = 0  # segments overtaken by a weight update in flight and sampled again (partial rollouts)
    forks: int = 0  # fork points branched at (rollout.fork_at: entropy)
    # Environments (rollout.env; a stateless agent is one too), docs/environments.md:
    env_forks: dict[str, int] = field(default_factory=dict)  # fork mode -> instances made for new branches
    env_replayed_steps: int = 0  # steps replayed on fresh instances (fork: replay)
    env_timeouts: int = 0  # environment calls past rollout.env_timeout_s
    env_errors: int = 0  # branches stopped by a diverged replay or messages over the budget, close() failures
    env_episodes: int = 0  # episodes ended (reward read, instance closed), dropped ones aside
    env_episode_steps: int = 0  # Σ over those episodes of the steps on their path
    env_dropped: int = 0  # leaves removed from the tree: never trained on (a failed program run's too)
    env_diverged: int = 0  # replays (fork: replay) that did not rebuild the recorded episode
    dropped_too_long: int = 0  # of which: an agent's or environment's messages did not fit the budget
    # Episodes ended (not dropped) where the next message did not fit (rollout.env_overflow: unfinished).
    overflow_ended: int = 0
    unstarted: int = 0  # branches (or whole trees) that never started: a reset or copy failed
    failures: list[EpisodeFailure] = field(default_factory=list)  # branches dropped: user code failed
    env_live: int = 0  # instances still open when the tree was done (an abandoned call runs on)
    # Agent programs (rollout.program / rollout.program_command), docs/agent-programs.md:
    program_runs: int = 0  # runs started (the first, and one per fork)
    program_calls: int = 0  # calls the endpoint served (replayed ones included)
    program_replayed_calls: int = 0  # calls of forked runs answered from their parent's recording
    program_retokenized: int = 0  # assistant messages that matched no returned one (context, not trained)
    program_offpath_calls: int = 0  # calls that did not extend their run's path (served, never trained)
    program_ignored_params: int = 0  # request sampling fields ignored (temperature, top_p, ...)
    program_diverged: int = 0  # forked runs whose requests differed from the recording (dropped)
    program_errors: int = 0  # runs that raised, exited non-zero or gave a bad reward (dropped)
    program_timeouts: int = 0  # runs past rollout.program_timeout_s or idle past rollout.env_timeout_s (dropped)
    program_seconds: float = 0.0  # Σ wall-clock seconds of the runs
    finish_reasons: dict[str, int] = field(default_factory=dict)  # leaf reason → count
    shortfall_reason: str | None = None

    def count_leaves(self, leaves: Sequence[Node]) -> None:
        """``leaves`` and ``finish_reasons`` of a complete tree's leaves (no reason: ``"?"``)."""
        self.leaves = len(leaves)
        self.finish_reasons = dict(Counter(leaf.finish_reason or "?" for leaf in leaves))

    def finish_summary(self) -> str:
        """The leaves' finish reasons with their counts, sorted: ``"?: 2, length: 1, stop: 2"``."""
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.finish_reasons.items())) or "no leaves"

    @property
    def tokens_computed(self) -> int:
        """Prefill + decode tokens the engine actually ran through the model."""
        return self.prompt_tokens - self.cached_tokens + self.tokens_generated
