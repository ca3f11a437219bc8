"""Test-session settings: the suite runs on 2 CPU cores, several processes at a time.

The ``slow`` marker: tests that start Ray, DeepSpeed ranks, servers as subprocesses (SGLang,
`arbor serve` for a whole run), train through the ``arbor`` command or run a benchmark
script. ``pytest -m "not slow"`` leaves them out (docs/development.md); ``pytest`` runs
everything. Marked here, by file or by test, rather than in each file: one list to read.
"""

import os
from pathlib import Path

import pytest

# Before torch is imported anywhere: one thread per process, or ranks fight for 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every test of these files is slow.
SLOW_FILES = {
    "test_trainer.py", "test_startup.py", "test_agent_math.py", "test_multinode.py", "test_zero3.py",
    "test_tied_embeddings.py", "test_smollm2.py", "test_sglang_real.py", "test_sglang_runs.py", "test_sglang_scoring.py", "test_distill_run.py", "test_build_teacher.py",
    "test_sglang_lora.py", "test_build_tiny_model.py", "test_profile_learner_step.py",
    "test_bench_async.py", "test_bench_learning.py", "test_bench_lora_memory.py", "test_bench_loss_memory.py",
    "test_bench_packing.py", "test_bench_rollout.py", "test_bench_train_step.py", "test_bench_vs_trl.py",
    "test_bench_weight_sync.py", "test_ray_start.py", "test_two_nodes.py", "test_env_runs.py",
    "test_build_env_model.py",
}
# Slow tests of files whose other tests are fast: file -> test functions (all their parameters).
SLOW_TESTS = {
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
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts Ray, DeepSpeed ranks, servers or whole runs "
                                       "(left out by -m 'not slow'; tests/conftest.py lists them)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        if name in SLOW_FILES or getattr(item, "originalname", item.name) in SLOW_TESTS.get(name, ()):
            item.add_marker(pytest.mark.slow)
