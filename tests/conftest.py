"""Test-session settings: the suite runs on 2 CPU cores, several processes at a time.

The ``slow`` marker: tests that start Ray, DeepSpeed ranks, servers as subprocesses (SGLang,
`arbor serve` for a whole run), train through the ``arbor`` command or run a benchmark
script. ``pytest -m "not slow"`` leaves them out (docs/development.md); ``pytest`` runs
everything. Marked here, by file or by test, rather than in each file: one list to read.

The resource markers (``ray``, ``sglang``, ``netns``, ``envs``: ``RESOURCES``) say what a test
needs, so ``pytest -m sglang`` runs one kind; ``TIME_LIMITS`` gives the tests that need more
than pytest-timeout's default (``timeout`` in pyproject.toml) their own limit.
"""

import os
import threading
from pathlib import Path

import pytest
import pytest_timeout

# Before torch is imported anywhere: one thread per process, or ranks fight for 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every test of these files is slow.
SLOW_FILES = {
    "test_trainer.py", "test_startup.py", "test_program_runs.py", "test_agent_math.py", "test_multinode.py", "test_zero3.py",
    "test_tied_embeddings.py", "test_smollm2.py", "test_sglang_real.py", "test_sglang_runs.py", "test_sglang_scoring.py",
    "test_distill_run.py", "test_build_teacher.py",
    "test_sglang_lora.py", "test_build_tiny_model.py", "test_profile_learner_step.py",
    "test_bench_async.py", "test_bench_learning.py", "test_bench_lora_memory.py", "test_bench_loss_memory.py",
    "test_bench_packing.py", "test_bench_rollout.py", "test_bench_train_step.py", "test_bench_vs_trl.py",
    "test_bench_weight_sync.py", "test_ray_start.py", "test_two_nodes.py", "test_env_runs.py",
    "test_build_env_model.py",
}
# Slow tests of files whose other tests are fast: file -> test functions (all their parameters).
SLOW_TESTS = {
    "test_program_frameworks.py": {"test_a_framework_program_trains_two_steps"},
    "test_served_rewards.py": {"test_a_two_step_run_scored_by_a_judge_and_a_reward_server"},
    "test_sft.py": {"test_two_zero3_ranks_lower_the_loss_and_export", "test_torch_backend_run_resumes",
                    "test_the_sft_recipe_runs"},
    "test_lora.py": {"test_zero3_two_ranks_train_the_adapter_as_one_process", "test_sft_trains_an_adapter_and_resumes"},
    "test_learner.py": {"test_zero3_two_ranks_match_single_process",
                        "test_a_deepspeed_rank_starts_without_compiling_deepspeeds_muon_kernels"},
    "test_launch.py": {"test_auto_starts_embedded_servers_and_shuts_them_down",
                       "test_a_server_that_dies_raises_with_its_log_tail",
                       "test_every_flag_arbor_passes_is_one_sglang_parses",
                       "test_a_killed_server_restarts_on_its_url_with_its_log_appended",
                       "test_sglang_reads_the_engine_key_from_a_private_file_not_the_command_line"},
    "test_engine_auth.py": {"test_decisions_equal_sglangs_own_on_every_combination", "test_run_key_and_the_bind_warning",
                            "test_requests_without_the_key_are_refused_and_change_nothing",
                            "test_the_key_holder_gets_through_and_the_client_sends_it",
                            "test_the_key_is_in_no_command_line_and_no_log", "test_separate_admin_key_follows_sglang",
                            "test_unkeyed_server_on_a_network_address_warns",
                            "test_sglang_output_reaches_its_log_with_the_key_blanked",
                            "test_a_run_keys_its_engines_and_writes_the_key_nowhere"},
    "test_distributed.py": {"test_weight_sync_into_sglangs_own_group_code"},
    "test_server.py": {"test_update_weights_from_distributed_with_a_learner_process"},
    "test_dfs_learner.py": {"test_a_deepspeed_rank_adds_back_to_back_backwards",
                            "test_two_zero3_ranks_walk_different_trees_in_lockstep",
                            "test_two_zero3_ranks_train_a_lora_adapter_depth_first_as_one_packed_process"},
    "test_bench_tree_execution.py": {"test_smoke_run_reports_every_case_and_the_result_keys",
                                     "test_the_cpu_memory_probe_prints_a_step_peak_in_mib",
                                     "test_cuda_without_a_gpu_is_a_clear_error"},
    "test_build_paged_model.py": {"test_the_builder_writes_a_model_and_problem_files"},
    "test_evaluate.py": {"test_arbor_eval_command_on_the_quickstart_model",
                         "test_arbor_eval_runs_environment_episodes_scored_by_the_environment",
                         "test_arbor_eval_runs_agent_episodes_on_the_quickstart_model",
                         "test_arbor_eval_without_a_set_says_so"},
    "test_rollout_correction.py": {"test_a_bf16_engine_shows_a_mismatch_the_float32_engine_does_not"},
    "test_context_check.py": {"test_arbor_train_refuses_a_depth_far_beyond_the_tiny_models_context"},
    "test_weight_sync.py": {"test_sync_to_arbor_serve", "test_version_mismatch_is_an_error"},
    "test_lora_sync.py": {"test_lora_sync_to_arbor_serve", "test_a_lora_run_syncs_only_the_adapter",
                          "test_a_restarted_engine_gets_the_adapters_back"},
    "test_loggers.py": {"test_arbor_sft_logs_to_every_logger"},
    # The adapters' and the paged lookup's arbor train runs (tests/adapter_runs.py).
    "test_adapters_mcp.py": {"test_two_rl_steps_of_arbor_train_with_the_servers_tools"},
    "test_adapters_openenv.py": {"test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards"},
    "test_adapters_reasoning_gym.py": {"test_two_rl_steps_of_arbor_train_on_a_generated_set_scored_by_its_dataset"},
    "test_adapters_textarena.py": {"test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards"},
    "test_adapters_verifiers.py": {"test_two_rl_steps_of_arbor_train_run_the_environments_loop"},
    "test_paged_lookup.py": {"test_the_config_forks_after_the_page_and_the_environment_gives_the_reward"},
    "test_async_rollouts.py": {"test_the_quickstart_as_shipped_trains_every_step_with_the_producer_ahead"},
}



# What a test needs beside arbor's Python packages, by marker: "file.py" marks every test of
# the file, "file.py::test_name" one test (all its parameters).
RESOURCES = {
    # Starts Ray: a whole run (`train()`, `arbor train`) or arbor's start_ray.
    "ray": {
        "test_trainer.py", "test_env_runs.py", "test_multinode.py", "test_ray_start.py", "test_sglang_runs.py",
        "test_two_nodes.py", "test_bench_async.py", "test_bench_learning.py", "test_program_runs.py",
        "test_program_frameworks.py::test_a_framework_program_trains_two_steps",
        "test_agent_math.py::test_agent_math_run_calls_the_tool_and_logs_tool_errors",
        "test_startup.py::test_ray_started_early_is_awaited_and_outlives_the_thread_that_started_it",
        "test_smollm2.py::test_one_train_step_exports_a_tied_model",
        "test_context_check.py::test_arbor_train_refuses_a_depth_far_beyond_the_tiny_models_context",
        "test_lora_sync.py::test_a_lora_run_syncs_only_the_adapter",
        "test_lora_sync.py::test_a_restarted_engine_gets_the_adapters_back",
        "test_engine_auth.py::test_a_run_keys_its_engines_and_writes_the_key_nowhere",
        "test_rollout_correction.py::test_a_bf16_engine_shows_a_mismatch_the_float32_engine_does_not",
        "test_paged_lookup.py::test_the_config_forks_after_the_page_and_the_environment_gives_the_reward",
        "test_adapters_mcp.py::test_two_rl_steps_of_arbor_train_with_the_servers_tools",
        "test_adapters_openenv.py::test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards",
        "test_adapters_reasoning_gym.py::test_two_rl_steps_of_arbor_train_on_a_generated_set_scored_by_its_dataset",
        "test_adapters_textarena.py::test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards",
        "test_adapters_verifiers.py::test_two_rl_steps_of_arbor_train_run_the_environments_loop",
    },
    # Runs a real SGLang (ARBOR_SGLANG_PYTHON: tests/sglang_env.py) or imports its code there.
    "sglang": {
        "test_sglang_real.py", "test_sglang_runs.py", "test_sglang_lora.py",
        "test_two_nodes.py::test_a_real_sglang_server_on_the_other_node",
        "test_bench_rollout.py::test_bench_rollout_on_a_real_sglang_server_against_the_embedded_engine",
        "test_distributed.py::test_flat_layout_is_sglangs", "test_distributed.py::test_weight_sync_into_sglangs_own_group_code",
        "test_engine_auth.py::test_decisions_equal_sglangs_own_on_every_combination",
        "test_launch.py::test_every_flag_arbor_passes_is_one_sglang_parses",
        "test_launch.py::test_sglang_reads_the_engine_key_from_a_private_file_not_the_command_line",
    },
    # Builds network namespaces (root, iproute2: tests/netns_cluster.py).
    "netns": {"test_two_nodes.py"},
    # Imports an environment library of the envs extra (tests/adapter_packages.py).
    "envs": {
        "test_adapters_mcp.py", "test_adapters_openenv.py", "test_adapters_reasoning_gym.py",
        "test_adapters_textarena.py", "test_adapters_verifiers.py", "test_build_env_model.py",
        "test_public_api.py::test_every_public_name_imports_from_its_module",
    },
}
# Seconds for the tests that need more than the default (same notation; a test's own entry
# wins over its file's). A test that runs subprocesses under timeouts gets their sum and a
# minute or more, so that a hung subprocess fails its test with its output rather than ending
# the session here (pytest-timeout's thread method dumps every thread's stack, then exits).
TIME_LIMITS = {
    "test_trainer.py": 600, "test_env_runs.py": 600, "test_startup.py": 600, "test_zero3.py": 600,
    "test_multinode.py": 600, "test_sglang_lora.py": 600, "test_tied_embeddings.py": 600,
    "test_sglang_real.py": 900, "test_sglang_runs.py": 900, "test_smollm2.py": 900,
    "test_sglang_runs.py::test_quickstart_async_on_sglang_then_arbor_eval": 1860,
    "test_sglang_runs.py::test_an_environment_forked_by_replay_on_sglang_asynchronously": 1200,
    # The module's cluster starts with its first test (up to ~8 minutes under its own timeouts).
    "test_two_nodes.py": 1500,
    "test_two_nodes.py::test_ranks_on_two_addresses_learn_as_on_one_node": 2100,
    "test_two_nodes.py::test_weights_by_disk_a_lost_node_stops_the_run_naming_it_and_resume_continues": 2100,
    "test_agent_math.py": 600, "test_agreement_math_verify.py::test_agreement_counts_boxed_cases_and_false_positives": 400,
    "test_build_tiny_model.py": 400, "test_learner.py": 400, "test_loggers.py": 400, "test_launch.py": 400,
    "test_dfs_learner.py": 700, "test_lora.py": 500, "test_distributed.py": 700, "test_sft.py": 700,
    "test_evaluate.py": 700, "test_rollout_correction.py": 700, "test_build_paged_model.py": 700,
    "test_profile_learner_step.py": 700, "test_cuda.py": 700,
    "test_bench_lora_memory.py": 400, "test_bench_loss_memory.py": 400, "test_bench_packing.py": 400,
    "test_bench_rollout.py": 400, "test_bench_weight_sync.py": 400, "test_bench_tree_execution.py": 700,
    "test_bench_rollout.py::test_bench_rollout_on_a_real_sglang_server_against_the_embedded_engine": 700,
    "test_bench_vs_trl.py": 700, "test_bench_async.py": 1000, "test_bench_learning.py": 1000,
    "test_build_env_model.py": 1000,
    # Whole `train()` runs in files whose other tests are fast.
    "test_program_runs.py": 600, "test_program_frameworks.py::test_a_framework_program_trains_two_steps": 600,
    "test_lora_sync.py": 600, "test_engine_auth.py::test_a_run_keys_its_engines_and_writes_the_key_nowhere": 600,
    "test_paged_lookup.py::test_the_config_forks_after_the_page_and_the_environment_gives_the_reward": 600,
    "test_adapters_mcp.py::test_two_rl_steps_of_arbor_train_with_the_servers_tools": 600,
    "test_adapters_openenv.py::test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards": 600,
    "test_adapters_reasoning_gym.py::test_two_rl_steps_of_arbor_train_on_a_generated_set_scored_by_its_dataset": 600,
    "test_adapters_textarena.py::test_two_rl_steps_of_arbor_train_replay_to_the_trees_and_rewards": 600,
    "test_adapters_verifiers.py::test_two_rl_steps_of_arbor_train_run_the_environments_loop": 600,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts Ray, DeepSpeed ranks, servers or whole runs "
                                       "(left out by -m 'not slow'; tests/conftest.py lists them)")
    config.addinivalue_line("markers", "ray: starts Ray (a whole run or arbor's start_ray)")
    config.addinivalue_line("markers", "sglang: runs a real SGLang (ARBOR_SGLANG_PYTHON) or its code")
    config.addinivalue_line("markers", "netns: builds a cluster of network namespaces (root, iproute2)")
    config.addinivalue_line("markers", "envs: needs an environment library of the envs extra")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        test = f"{name}::{getattr(item, 'originalname', item.name)}"
        if name in SLOW_FILES or test.split("::")[1] in SLOW_TESTS.get(name, ()):
            item.add_marker(pytest.mark.slow)
        for marker, listed in RESOURCES.items():
            if name in listed or test in listed:
                item.add_marker(marker)
        limit = TIME_LIMITS.get(test, TIME_LIMITS.get(name))
        if limit is not None and item.get_closest_marker("timeout") is None:  # a mark in the file wins
            item.add_marker(pytest.mark.timeout(limit))


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    """pytest-timeout's thread method, with a first line naming the test: its own report (every
    thread's stack, then the session ends) names it only inside the main thread's stack."""
    if settings.method != "thread":
        return None

    def expire() -> None:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture:  # the line goes to the terminal, not into the test's captured output
            capture.suspend_global_capture(item)
        item.config.get_terminal_writer().line(
            f"\n{item.nodeid} ran past its time limit of {settings.timeout:.0f} s (tests/conftest.py's "
            "TIME_LIMITS, else timeout in pyproject.toml): every thread's stack follows")
        pytest_timeout.timeout_timer(item, settings)

    timer = threading.Timer(settings.timeout, expire)
    timer.name = f"time limit of {item.nodeid}"
    item.cancel_timeout = lambda: (timer.cancel(), timer.join())  # what pytest-timeout's teardown calls
    timer.start()
    return True
