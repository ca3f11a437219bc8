"""Mutation testing of one core module against its own tests, with mutmut.

    python scripts/mutation.py train.advantage      # or train.packing, train.loss, rollout.sampler, ...
    python scripts/mutation.py rollout.rewards --show    # also print the diff of every survivor
    python scripts/mutation.py --list               # the modules and the tests each runs

mutmut (``pip install -e '.[dev]'``) changes one thing at a time in the module (``<`` for
``<=``, ``+ 1`` for ``- 1``, a dropped argument, a swapped default, ...) and runs the tests
that reach the changed function; a mutant no test fails on "survives" and is a behaviour
no test pins. Each module runs in its own scratch copy of the repo under
``.mutation/MODULE/`` (git-ignored), so several modules can run side by side and the
work tree is never touched; mutmut's cache lives there too, so a second run only
re-tests what changed (delete the folder to start over). Mutants listed in
:data:`EQUIVALENT` change nothing observable (a log format, a default no caller relies
on, ...): they are left out of the score, each with the reason.

Ends with ``RESULT module=M killed=K total=T score=S survived=...``. On 2 quiet cores a
module takes 10–60 minutes; run it under ``nice`` (docs/development.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Rollout correction's quick tests (the rest of the file trains a model or runs the quickstart).
_CORRECTION_TESTS = [f"tests/test_rollout_correction.py::{name}" for name in (
    "test_shared_node_takes_each_leafs_weight", "test_correction_without_recomputed_old_logprobs_is_an_error",
    "test_asynchronous_behaviour_cap_and_the_correction_share_one_weight", "test_tree_packed_equals_linearised_per_leaf")]

# module -> the test files that are its own tests (what a developer changing it runs).
TESTS: dict[str, list[str]] = {
    "train.advantage": ["tests/test_advantage.py"],
    "train.packing": ["tests/test_packing.py",
                # linearise_trees' own hand-worked tests (the rest of the file trains models)
                "tests/test_linearise.py::test_each_leaf_becomes_a_chain_by_hand",
                "tests/test_linearise.py::test_per_token_advantages_follow_their_leaf",
                "tests/test_linearise.py::test_wrong_advantage_count_names_the_problem",
                "tests/test_linearise.py::test_unique_tokens_of_chains_are_the_linearised_tokens",
                # train_only (a rank's share of a split tree) and the correction columns
                "tests/test_rank_balance.py", *_CORRECTION_TESTS],
    # arbor/train/loss.py: the pure objective (token_sums, combine, ...), pinned by hand-worked numbers.
    "train.loss": ["tests/test_loss.py"],
    # arbor/train/packed_loss.py: the forwards and packing around the objective (policy_loss,
    # pack_loss, the SFT loss), pinned by hand-worked numbers and tree == padded agreement.
    "train.packed_loss": ["tests/test_loss.py", "tests/test_tree_vs_linear.py", "tests/test_logprobs.py",
                    "tests/test_linearise.py", "tests/test_lm_head.py",
                    "tests/test_sft.py::test_tree_sft_gradients_equal_linear_sft",
                    # policy_backward and PolicyObjective.with_stats (the depth-first walk)
                    "tests/test_dfs.py",
                    # the rollout-correction branch of PolicyObjective (recomputed π_old)
                    *_CORRECTION_TESTS],
    # arbor/train/logprobs.py: the log-prob forwards of packs and padded sequences.
    "train.logprobs": ["tests/test_loss.py", "tests/test_logprobs.py", "tests/test_lm_head.py",
                 "tests/test_tree_vs_linear.py"],
    "rollout.sampler": ["tests/test_sampler.py", "tests/test_sampler_agents.py", "tests/test_entropy_fork.py",
                # multi-turn episodes: environment turns in segment and entropy rounds, the fallback's cuts
                "tests/test_env_forks.py",
                # partial rollouts (RoundBatcher.generate_fresh) on the embedded engine
                "tests/test_async_rollouts.py::test_without_partial_rollouts_in_flight_segments_keep_the_old_version",
                "tests/test_async_rollouts.py::test_partial_rollouts_sample_overtaken_segments_again_under_the_new_weights",
                "tests/test_async_rollouts.py::test_partial_rollouts_count_every_time_a_segment_is_overtaken",
                "tests/test_async_rollouts.py::test_resampling_gives_up_with_a_named_error_when_every_round_is_overtaken"],
    "rollout.budget": ["tests/test_sampler.py"],
    # arbor/rollout/agent_thread.py: where agent steps run (their time limit, a raising step).
    "rollout.agent_thread": ["tests/test_sampler_agents.py"],
    "rollout.rewards": ["tests/test_rewards.py",
                        # a served term beside a Python one: RewardPool.score adds the served scores
                        "tests/test_served_rewards.py::test_a_classifier_reward_model_and_the_pool_combines_terms_in_config_order"],
    # Environments: the protocol, time-limited calls and the live cap, forks, episodes.
    # (tests/test_agent_sampling.py: multi-turn agents on the embedded engine: steps, overflow, drops)
    "rollout.environments": ["tests/test_environments.py", "tests/test_env_forks.py", "tests/test_agent_sampling.py"],
    "rollout.env_calls": ["tests/test_env_calls.py", "tests/test_env_forks.py", "tests/test_agent_sampling.py", "tests/test_sampler_agents.py"],
    "rollout.env_forks": ["tests/test_env_forks.py", "tests/test_agent_sampling.py"],
    "rollout.episodes": ["tests/test_env_forks.py", "tests/test_sampler_agents.py", "tests/test_agent_sampling.py",
                         "tests/test_environments.py"],
}

# Mutant name -> why it cannot be told apart from the original by any test.
_THREAD_NAME = ("the id in the agent-step thread's name (the future's, or None's): the name still says agent-step, "
                "and the id only tells threads apart in a dump")
_ROOT_OFFSET = ("the root path's log-prob 1.0 for 0.0: every path compared in a round descends from it, and a common offset leaves the softmax split unchanged (independent mode does not split)")
_ON_CPU = "a device argument the CPU tests cannot see: the model and every tensor are on the CPU already"
_INVARIANT = ("the error (or its text) of an internal invariant the sampler never breaks: a copy-forked or "
              "stepped 'fork: none' branch always owns its instance, copies are handed over one per child, and "
              "a 'fork: none' path that has stepped is given one copy; no input reaches it")
_DROPPED_LABEL = ("the finish reason written on a leaf being dropped (None, or the other timeout's label): "
                  "it is removed from the tree when the tree closes, and no label but 'stop' makes a leaf "
                  "a fallback source, so nothing reads it")
_MEMORY = ("a budget that shapes memory, not values: a default one token larger (group_tokens, pack_tokens), or "
           "the lm-head's chunking (chunk_tokens 1 for 0, or left at 0): the same log-probs, loss and gradients")
_PADDED_COUNTS = ("the padded reference's leaf counts (all 1) in torch's default float32 (arbor never changes "
                  "it) for logp's dtype: 1.0 is exact in both, they only multiply no-grad metric terms that "
                  "promote to logp's dtype, and a float32 sum of < 2^24 ones is exact")
_NO_LOGPROBS = ("require_logprobs None for False: pack_trees and padded_token_fields only ever test it for "
                "truth, and None is false like False")
_FLOAT_MASK = ("the padded rows' attention mask in float32 for int64: transformers casts it to bool "
               "(create_causal_mask), and BLOOM's ALiBi positions, the running sum of 0.0/1.0, are the same numbers")
_RIGHT_PADDED = ("no attention mask on right-padded rows: a causal model's real tokens never see the padding "
                 "after them, positions count from 0 either way, and ALiBi (BLOOM) builds the same arange "
                 "over real tokens (the BLOOM padded == per-leaf test passes on it)")
_EMPTY_TARGETS = ("a scored index's dtype left to torch.tensor: it infers int64 from Python ints; an empty "
                  "list (leaves without response tokens) gives float32, which gather accepts as an empty "
                  "index, so the outputs are the same empty tensors")
_COUNTS = ("a node's leaf count in float32 for float64: a count of leaves (< 2^24) is exact in both, "
           "and torch.cat promotes it to the float64 of the prompt's zeros that every pack starts with")
_INFERRED = ("a packed column's dtype left to torch.tensor: it infers int64 from Python ints and bool "
             "from bools, the dtypes named (a pack is never empty: it holds a trained token)")
_ZEROS = ("the prompt's zero weights in float32 for float64: torch.cat promotes them to the "
          "float64 of the node weights beside them, and 0 is exact in both")
_NO_LEAVES = ("unreachable: tree.nodes() leaves out the root and every other node has a leaf below it "
              "(a node without children is one), so each has an entry in `below`: _node_weights never "
              "takes its 'no leaves' branch, nor .get's default")
_KILLED_JOIN = ("the limit on join() right after SIGKILL (none, or one second more): a killed process "
                "exits within milliseconds, so join returns long before any limit; only a process "
                "stuck in uninterruptible kernel I/O outlives SIGKILL, which no test can stage")
_EOF_JOIN = ("the limit on join() (none, or 6 s for 5 s) for a starting worker whose pipe reported "
             "end-of-file: the worker holds the only other end, which closes as it exits (the kernel "
             "closes a process's files among its last steps), so join returns at once; only a reward "
             "module that closed descriptors it does not own at import could keep it alive")
_EXACT_CLOCK = (">= for > against a time limit: the clock never lands on the exact limit, and if it did "
                "the next wait(0) acts a microsecond later")
EQUIVALENT: dict[str, str] = {
    **{f"arbor.train.packed_loss.xǁPolicyObjectiveǁ__call____mutmut_{n}": _ON_CPU for n in (2, 4, 6, 62, 64)},
    "arbor.train.packed_loss.x_sft_token_loss__mutmut_5": _ON_CPU,
    **{f"arbor.train.logprobs.x_padded_token_logprobs__mutmut_{n}": _ON_CPU for n in (86, 89, 96, 99)},
    **{f"arbor.train.packed_loss.x_policy_backward__mutmut_{n}": _MEMORY for n in (3, 6, 10, 59, 72)},
    "arbor.train.packed_loss.x_policy_backward__mutmut_82":
        "pack_budget('dfs', None): dfs packs whole trees whatever pack_tokens says (pack_budget ignores it)",
    "arbor.train.packed_loss.x_policy_backward__mutmut_57":
        "the packed path's attention left at its default 'auto' where 'auto' was passed on: the same kernel",
    # rollout.environments, numbered on the code of 2026-11-28
    **{f"arbor.rollout.environments.x_{name}__mutmut_{i}": (
        "the name of an agent's source when none is given: every source a user sees comes from rollout_env, "
        "which passes rollout.agent (always set there); sample_trees' own agent sources print no name")
       for name, i in (("agent_source", 1), ("agent_source", 2), ("rollout_env", 33), ("rollout_env", 34))},
    "arbor.rollout.environments.xǁAgentEnvǁ__init____mutmut_2":
        "an AgentEnv's first problem None for {}: reset (or copy) sets it before step reads it",
    # rollout.env_forks, numbered on the code of 2026-11-28
    **{f"arbor.rollout.env_forks.xǁForksǁ{name}__mutmut_{i}": _INVARIANT for name, numbers in (
        ("instance", (6, 8, 9, 12, 13, 15, 16, 17, 18)), ("prepare", (9, 10, 12, 15, 16, 17, 33)),
        ("hand_over", (6, 10, 11, 13))) for i in numbers},
    **{f"arbor.rollout.env_forks.xǁForksǁ__init____mutmut_{i}": (
        "the first value of mode/problem/seed/start: begin sets all four, right after the tree's reset, "
        "before anything reads them") for i in (5, 6, 7, 12, 13, 14, 15)},
    # rollout.episodes, numbered on the code of 2026-11-28
    **{f"arbor.rollout.episodes.xǁTreeEpisodesǁ{name}__mutmut_{i}": _DROPPED_LABEL
       for name, i in (("_failed", 21), ("_timed_out", 3), ("_timed_out", 4), ("_timed_out", 5), ("after_turn", 211))},
    **{f"arbor.rollout.episodes.xǁTreeEpisodesǁ__init____mutmut_{i}": (
        "the first value of problem/start/seed: reset sets all three before anything reads them") for i in (30, 31, 32, 33)},
    **{f"arbor.rollout.episodes.xǁTreeEpisodesǁ_finish__mutmut_{i}": _DROPPED_LABEL for i in (15, 19, 22)},
    **{f"arbor.rollout.episodes.xǁTreeEpisodesǁclose__mutmut_{i}": (
        "= for += (or 'or' for 'and' before an empty drop): a tree's stats start at 0 and close() runs once per "
        "tree, the only place in this module that adds to env_live and env_dropped; dropping no leaves is a no-op")
       for i in (1, 5, 8)},
    "arbor.rollout.episodes.xǁTreeEpisodesǁprepare__mutmut_1":
        "prepare(None, ...) for prepare(tree, ...): Forks.prepare does not read its tree",
    "arbor.rollout.episodes.xǁTreeEpisodesǁ_timed_out__mutmut_11":
        "turn None for an agent's timeout: _failure records None for every agent failure anyway",
    "arbor.rollout.episodes.xǁTreeEpisodesǁreset__mutmut_56":
        "_where(None) for _where(0): both are false, so neither names a turn: the same text",
    **{f"arbor.rollout.episodes.x_reset_seed__mutmut_{i}": (
        "another fixed tag in the reset seed's key (node -2 or None, fork 1 or None): still one seed per "
        "tree and step, reproducible, and no request's (requests have node ids and forks ≥ 0)") for i in (3, 4, 10, 11)},
    # train.packing, numbered on the code of 2026-11-28 (renumber after editing the module)
    **{f"arbor.train.packing.x__node_weights__mutmut_{i}": _NO_LEAVES for i in (63, 65, *range(68, 87))},
    "arbor.train.packing.x__node_weights__mutmut_115": _COUNTS,
    "arbor.train.packing.x__node_weights__mutmut_118": _COUNTS,
    "arbor.train.packing.x__serialise__mutmut_22": _ZEROS,
    "arbor.train.packing.x__serialise__mutmut_24": _ZEROS,
    "arbor.train.packing.x__serialise__mutmut_68":
        "the prompt's placeholder behaviour log-probs 1.0 for 0.0: prompt tokens are never trained, "
        "and old_logprobs keeps only trained tokens' values (torch.where(trained, old, 0))",
    "arbor.train.packing.x__serialise__mutmut_74":
        "the prompt's placeholder π_old 1.0 for 0.0: prompt tokens are never trained, and "
        "prox_logprobs keeps only trained tokens' values (torch.where(trained, prox, 0))",
    "arbor.train.packing.x__serialise__mutmut_150":
        "parents range(start, start + n + 1) for + n - 1: the list is cut to its first n entries, "
        "the same ones",
    **{f"arbor.train.packing.x__serialise__mutmut_{i}": _INFERRED
       for i in (275, 277, 302, 304, 308, 310, 314, 316, 320, 322, 326, 328)},
    "arbor.train.packing.x_linearise_trees__mutmut_41":
        "cast(None, a) for cast(Sequence[float], a): typing.cast returns its value unchanged at run time",
    **{f"arbor.train.packing.xǁPackedBatchǁ__post_init____mutmut_{i}": (
        "origin left in the general column check: it is checked on its own just below with the same "
        "entry, so the error is the same") for i in (11, 12)},
    "arbor.rollout.rewards.xǁRewardPoolǁ_collect_finished__mutmut_27":
        "break for continue after keeping a finished result: a worker left busy is restarted at "
        "the start of the next batch anyway (score's first loop)",
    "arbor.train.packing.x_assign_to_ranks__mutmut_18":
        "every rank's load starts at 1.0 for 0.0: the same offset on every rank, the same choices",
    "arbor.train.packed_loss.x_policy_loss__mutmut_107":
        "'or' for 'and' in the no-trees assert: total and all_sums are None together or not at all",
    "arbor.train.packed_loss.x__padded_sums__mutmut_18": _ON_CPU,
    "arbor.train.packed_loss.x__padded_sums__mutmut_21": _ON_CPU,
    "arbor.train.packed_loss.x__padded_sums__mutmut_26": _ON_CPU,
    "arbor.train.packed_loss.x__padded_sums__mutmut_29": _ON_CPU,
    "arbor.train.packed_loss.x__padded_sums__mutmut_84": _PADDED_COUNTS,
    "arbor.train.packed_loss.x__padded_sums__mutmut_87": _PADDED_COUNTS,
    "arbor.train.packed_loss.x__padded_sums__mutmut_88": _ON_CPU,
    "arbor.train.packed_loss.x_sft_loss__mutmut_41": _NO_LOGPROBS,
    "arbor.train.packed_loss.x_sft_loss__mutmut_51": _ON_CPU,
    "arbor.train.packed_loss.x_sft_loss__mutmut_60": _ON_CPU,
    "arbor.train.packed_loss.x_sft_loss__mutmut_63": _ON_CPU,
    "arbor.train.packed_loss.x_sft_loss__mutmut_75": _NO_LOGPROBS,
    "arbor.train.packed_loss.x_sft_loss__mutmut_77":
        "pack_trees without advantages=None: None is its default, the same call",
    "arbor.train.packed_loss.x_pack_loss__mutmut_31": _ON_CPU,
    "arbor.train.packed_loss.x_pack_loss__mutmut_33": _ON_CPU,
    "arbor.train.packed_loss.x__padded_sums__mutmut_85": _ON_CPU,
    "arbor.train.packed_loss.x_sft_loss__mutmut_54": _ON_CPU,
    "arbor.train.logprobs.x_pack_token_logprobs__mutmut_7": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_47": _RIGHT_PADDED,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_43": _RIGHT_PADDED,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_32": _FLOAT_MASK,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_35": _FLOAT_MASK,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_94": _EMPTY_TARGETS,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_97": _EMPTY_TARGETS,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_2": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_50": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_51": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_85": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_88": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_95": _ON_CPU,
    "arbor.train.logprobs.x_padded_token_logprobs__mutmut_98": _ON_CPU,
    "arbor.rollout.agent_thread.x_in_daemon_thread__mutmut_21": _THREAD_NAME,
    "arbor.rollout.sampler.xǁ_TreeSamplerǁrun__mutmut_10": _ROOT_OFFSET,
    "arbor.rollout.sampler.xǁ_TreeSamplerǁrun__mutmut_45": _ROOT_OFFSET,  # numbered 2026-11-28
    "arbor.rollout.sampler.xǁ_TreeSamplerǁ_fallback__mutmut_24": _ROOT_OFFSET,
    # numbered 2026-11-29 (run, _round, _prepare, _whole_paths, sample_trees)
    **{f"arbor.rollout.sampler.xǁ_TreeSamplerǁrun__mutmut_{i}": (
        "return for break: nothing follows run's loop, so leaving the loop is leaving run") for i in (62, 65, 73)},
    **{f"arbor.rollout.sampler.xǁ_TreeSamplerǁ{name}__mutmut_{i}": (
        "prepare(None, ...) for prepare(tree, ...): the instances a node's copies get do not depend on the tree "
        "(Forks.prepare does not read it)") for name, i in (("_round", 3), ("_prepare", 3), ("_whole_paths", 7))},
    **{f"arbor.rollout.sampler.xǁ_TreeSamplerǁ_whole_paths__mutmut_{i}": (
        "a finished model turn's path score (None or 1.0 for 0.0) in entropy rounds: only the node of the path "
        "that goes on after its environment turn is read") for i in (77, 80)},
    "arbor.rollout.sampler.x_sample_trees__mutmut_81": (
        "the tree before reset is '' for None: close() drops branches only of a tree that exists, and before "
        "reset returns no branch was sampled (the list it reads is empty)"),
    "arbor.rollout.sampler.x_sample_trees__mutmut_95": (
        "unstarted = 1 for += 1: each tree has its own SampleStats, and a tree whose reset failed counts once"),
    "arbor.rollout.sampler.x__response_upto__mutmut_2":
        "tree.response_ids(root) is [] anyway: the guard only saves a call",
    "arbor.rollout.sampler.xǁ_TreeSamplerǁ_path_at__mutmut_3":
        "tree.path(root) is [] anyway: the guard only saves a call",
    "arbor.rollout.rewards.xǁRewardPoolǁ_replace__mutmut_1": _KILLED_JOIN,
    "arbor.rollout.rewards.xǁRewardPoolǁ_replace__mutmut_2": _KILLED_JOIN,
    "arbor.rollout.rewards.xǁRewardPoolǁclose__mutmut_3": _KILLED_JOIN,
    "arbor.rollout.rewards.xǁRewardPoolǁclose__mutmut_4": _KILLED_JOIN,
    "arbor.rollout.rewards.xǁRewardPoolǁ_receive__mutmut_3": _EOF_JOIN,
    "arbor.rollout.rewards.xǁRewardPoolǁ_receive__mutmut_4": _EOF_JOIN,
    "arbor.rollout.rewards.xǁRewardPoolǁ_score__mutmut_78": _EXACT_CLOCK,  # start_timeout_s (numbered 2026-11-28, evening)
    "arbor.rollout.rewards.xǁRewardPoolǁ_score__mutmut_70": _EXACT_CLOCK,  # timeout_s
    "arbor.rollout.rewards.x__worker_main__mutmut_6":
        "StreamHandler(None) for StreamHandler(sys.stderr): logging takes None to mean "
        "sys.stderr, read at the same moment, so the handler writes to the same stream",
    "arbor.train.advantage.x__std__mutmut_3":
        "_std of < 2 values returns 1.0 for 0.0: it only divides R − mean (0 for one leaf) and "
        "V(node) − V(parent) (0 without siblings), so every result is still 0",
    "arbor.train.advantage.x_reinforce_pp_advantages__mutmut_6":
        "std_normalize=None for False: both are falsy, Dr.GRPO either way",
    "arbor.rollout.budget.x_is_repetitive__mutmut_4":
        "the short-cut at len < window + count − 2: at exactly window + count − 2 items there are "
        "count − 1 windows, too few to repeat count times, so the full count says False too",
    "arbor.rollout.budget.x_is_repetitive__mutmut_13":
        "one more window, cut short at the end: a shorter tuple equals no full window and occurs "
        "once, so it reaches count only when count is 1, when a full window already does",
    "arbor.rollout.budget.x_largest_remainder__mutmut_3":
        "floor(q − 1e-9): an exact integer quota floors one lower with remainder 1.0, the largest "
        "possible, so it gets its unit back first: the same integers",
    "arbor.train.advantage.x_treepo_advantages__mutmut_34":
        "weight 2.0 for 1.0 in the 'mean' aggregate: num and den both double, exactly",
}

COPIED = ("arbor", "tests", "rewards", "agents")  # what the tests import or read
LINKED = ("models", "data", "configs")  # what some tests read only (the built tiny models, ...)


def _config(module: str) -> str:
    tests = ", ".join(f'"{t}"' for t in TESTS[module])
    return (
        "[tool.mutmut]\n"
        'source_paths = ["arbor"]\n'
        f'only_mutate = ["arbor/{module.replace(".", "/")}.py"]\n'
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
        '# copied into mutants/ beside the tests (reward functions and agents named by module path)\n'
        'also_copy = ["rewards", "agents"]\n'
        '# -p no:cacheprovider: the copy has no .pytest_cache worth keeping\n'
        'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly"]\n'
        '# torch is not fork-safe once initialised: fork mutants from a clean server\n'
        'process_isolation = "forkserver"\n'
        "# A mutant's tests are stopped after (their measured time + 20 s) × 3 of wall clock (× 6\n"
        "# of CPU): mutmut's (time + 1 s) × 15 times out healthy mutants whose quick tests sit\n"
        "# starved for 15 s under chrt -i 0 on a busy machine; one that hangs costs a minute.\n"
        "timeout_constant = 20.0\n"
        "timeout_multiplier = 3.0\n"
        "use_git_change_detection = false\n"
    )


def _prepare(module: str) -> Path:
    """The scratch copy for ``module``: fresh sources, mutmut's cache kept."""
    work = ROOT / ".mutation" / module
    work.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        shutil.rmtree(work / name, ignore_errors=True)
        shutil.copytree(ROOT / name, work / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # mutmut runs the tests inside work/mutants/: link there what they read from the repo root.
    (work / "mutants").mkdir(exist_ok=True)
    for name in LINKED:
        if not (work / "mutants" / name).exists():
            (work / "mutants" / name).symlink_to(ROOT / name, target_is_directory=True)
    pyproject = (ROOT / "pyproject.toml").read_text()
    (work / "pyproject.toml").write_text(pyproject + "\n" + _config(module))
    # mutmut maps each function to the tests that reach it once, and re-maps only tests with
    # new names: after an edit to a test, or to the tests a module runs, its old map would
    # skip them. Start the map afresh.
    digest = hashlib.sha256(_config(module).encode() + b"".join(
        (work / "tests" / name).read_bytes() for name in sorted(os.listdir(work / "tests")) if name.endswith(".py")
    )).hexdigest()
    seen = work / "tests.sha256"
    if not seen.exists() or seen.read_text() != digest:
        (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
        seen.write_text(digest)
    return work


def _results(work: Path, env: dict[str, str]) -> dict[str, str]:
    """mutant name -> status ("killed", "survived", "no tests", "timeout", ...)."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                         cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    statuses = {}
    for line in out.splitlines():
        match = re.match(r"\s*(\S+): (.+)$", line)
        if match:
            statuses[match[1]] = match[2].strip()
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", nargs="?", choices=sorted(TESTS))
    parser.add_argument("--show", action="store_true", help="print the diff of every survivor")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="test only N mutants drawn at random (seed 0) and score those: an "
                             "estimate for a busy machine; without it every mutant is tested")
    parser.add_argument("--report", action="store_true",
                        help="only report the last (or running) run's verdicts, run nothing")
    args = parser.parse_args()
    if args.list or args.module is None:
        for module, tests in TESTS.items():
            print(f"{module:15} {' '.join(tests)}")
        return 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # import the mutants' copy
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.report:
        return _report(args.module, ROOT / ".mutation" / args.module, env, args.show, args.sample)
    again = (ROOT / ".mutation" / args.module / "mutants").exists()
    work = _prepare(args.module)
    log = work / "mutmut-run.log"  # mutmut redraws a progress line many times a second
    prefix = f"arbor.{args.module}."
    run = [sys.executable, "-m", "mutmut", "run", "--max-children", "2"]
    with log.open("w") as out:
        if args.sample:
            # Generate the mutants and map the tests, testing none (the pattern matches none) ...
            subprocess.run(run + [f"{prefix}zzz_no_such_mutant*"], cwd=work, env=env, stdout=out,
                           stderr=subprocess.STDOUT, check=False)
            names = sorted(n for n in _results(work, env) if n.startswith(prefix) and n not in EQUIVALENT)
            sample = random.Random(0).sample(names, min(args.sample, len(names)))
            (work / "sample.txt").write_text("\n".join(sample) + "\n")
            # ... then test the drawn ones that an earlier run has not already seen killed.
            known = _results(work, env)
            left = [n for n in sample if known.get(n) not in ("killed", "timeout")]
            if left:
                subprocess.run(run + left, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                               check=False)
        else:
            subprocess.run(run, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
            # mutmut keeps a survivor's verdict until its function changes: tests added since
            # the last run are tried on the survivors only when they are named. A timeout is
            # tried once more: a starved run looks like a hang (the report lists those left).
            left = [n for n, s in _results(work, env).items()
                    if n.startswith(prefix) and (s == "timeout" or again and s != "killed")]
            if left:
                subprocess.run(run + left, cwd=work, env=env, stdout=out,
                               stderr=subprocess.STDOUT, check=False)
    progress = re.findall(r"(\d+/\d+ +🎉.*?🧙 \d+)", log.read_text())
    print(progress[-1] if progress else f"mutmut printed no progress: see {log}")
    return _report(args.module, work, env, args.show, args.sample)


def _report(module: str, work: Path, env: dict[str, str], show: bool, sample: int = 0) -> int:
    """Print the equivalent mutants, the survivors and the RESULT line of ``module``
    (``sample``: of the mutants the last ``--sample`` run drew)."""
    prefix = f"arbor.{module}."
    statuses = _results(work, env)
    mine = {name: s for name, s in statuses.items() if name.startswith(prefix)}
    if sample:
        drawn = set((work / "sample.txt").read_text().split())
        mine = {name: s for name, s in mine.items() if name in drawn or name in EQUIVALENT}
    # A listed mutant that a test now kills was not equivalent after all: it counts as killed.
    equivalent = sorted(name for name, s in mine.items() if name in EQUIVALENT and s != "killed")
    scored = {name: s for name, s in mine.items() if name not in equivalent}
    killed = sum(s == "killed" or s == "timeout" for s in scored.values())
    # "not checked": the run was stopped before it got there (it resumes where it stopped).
    unchecked = sorted(name for name, s in scored.items() if s == "not checked")
    survivors = sorted(name for name, s in scored.items()
                       if s not in ("killed", "timeout", "not checked"))
    for name in equivalent:
        print(f"equivalent {name}: {EQUIVALENT[name]}")
    # A timeout counts as killed (mutmut's rule: the mutant hung or looped), but is listed:
    # on a starved machine a healthy run can time out too (run the module again to retry).
    timeouts = sorted(name for name, s in scored.items() if s == "timeout")
    for name in timeouts:
        print(f"timeout    {name}")
    for name in survivors:
        print(f"{scored[name]:10} {name}")
        if show:
            subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, env=env)
    total = len(scored) - len(unchecked)
    score = killed / total if total else 1.0
    print(f"RESULT module={module} killed={killed} total={total} score={score:.3f} "
          f"equivalent={len(equivalent)} survived={len(survivors)} timeout={len(timeouts)} "
          f"not_checked={len(unchecked)}"
          + (f" sample={sample}" if sample else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
