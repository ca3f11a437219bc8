"""The RL loop end to end on CPU: Ray-placed learner ranks, `arbor serve`, rewards, checkpoints;
synchronous, and asynchronous (``algorithm.max_staleness``)."""

import json
from pathlib import Path

import pytest
import torch
from async_checks import check_async_trained
from engine_kills import KillAtTheProducersRequest, kill_after_the_health_check
from safetensors.torch import load_file
from tiny_model import build_tiny_model_dir

from arbor.config_load import load_config
from arbor.errors import RunStopped
from arbor.run import checkpoint
from arbor.run.metrics import read_metrics
from arbor.run.trainer import train
from arbor.tree import RolloutTree

REWARD = '''
import os
import random


def coin(problem, completion):
    """Deterministic in the text: some leaves win, so every tree has an advantage signal."""
    return float(random.Random(completion).random() < 0.5)


def crashes(problem, completion):
    """A broken reward function: its worker dies on every check."""
    os._exit(1)
'''


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    model = build_tiny_model_dir(root / "model")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i} " * 3, "answer": "1"}) + "\n" for i in range(16)))
    (root / "coin_reward.py").write_text(REWARD)
    return root, model, data


def config(root, model, data, out, *overrides):
    return load_config(None, [
        f"model.path={model}", "model.chat_template=true", f"data.train_path={data}", "data.prompts_per_step=2",
        "rollout.width=4", "rollout.branch=2", "rollout.segment_tokens=4", "rollout.max_depth=3",
        "engine.kind=embedded", f"reward.functions=[{{fn: {root}/coin_reward.py:coin}}]", "reward.workers=1",
        "algorithm.dynamic_sampling=false", "optim.lr=1e-2", "learner.device=cpu", "learner.dtype=float32",
        "learner.pack_tokens=256", "data.max_prompt_tokens=64", "run.steps=2", f"run.output_dir={out}", "run.save_every=1", *overrides,
    ])


@pytest.mark.parametrize("execution", ["packed", "dfs"])
def test_two_zero3_ranks_under_ray_with_arbor_serve(run_inputs, tmp_path, execution):
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "out", "learner.backend=deepspeed", "learner.zero_stage=3",
                 "learner.num_ranks=2", f"learner.tree_execution={execution}")
    seen = []

    def check(ctx, step, metrics):
        versions = ctx.run_async(ctx.client.get_weight_version())
        checksum = ctx.learners.state_checksum()
        seen.append((step, versions, checksum, metrics))

    history = train(cfg, after_step=check)
    assert [s for s, *_ in seen] == [1, 2]
    for step, versions, checksum, metrics in seen:
        assert versions == [str(step)]  # the engine serves the weights of this step's update
        assert checksum[0] == pytest.approx(checksum[1])  # both ranks gathered the same model
        assert metrics["sync/logprob_gap"] <= 1e-4, metrics
        assert metrics["train/linearised_tokens"] > metrics["train/tokens"] > 0
        # Two trees a step, dealt one to each rank (both in one 256-token pack otherwise).
        assert 1.0 <= metrics["train/rank_imbalance"] < 1.5, metrics["train/rank_imbalance"]
    assert seen[0][2][0] != seen[1][2][0]  # the weights changed
    exported = load_file(str(tmp_path / "out" / "hf" / "model.safetensors"))
    initial = load_file(str(Path(model) / "model.safetensors"))
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)
    # TensorBoard events, a checkpoint, the per-step jsonl with the documented metrics.
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text() == "step-000002"
    logged = read_metrics(tmp_path / "out")
    for key in ("reward/mean", "reward/accuracy", "response/length_mean", "tree/sharing_ratio", "tree/leaves",
                "rollout/tokens_computed", "train/tokens_saved", "train/loss", "time/rollout_s", "time/reward_s", "time/train_s"):
        assert key in logged[-1], key
    assert [m["step"] for m in logged] == [1, 2] and history[-1]["reward/mean"] == logged[-1]["reward/mean"]


class Killed(Exception):
    pass


def test_resume_after_a_kill_repeats_the_next_step(run_inputs, tmp_path):
    """A run dies in step 3, after checkpoint 2: resumed, step 3 gives the metrics it gave.

    (Two fresh runs may differ slightly: the engine's logprobs depend on how requests
    were batched, ~1e-6, and Adam's first steps amplify such noise in tiny gradients.
    Resuming restores the exact state, so the redone step matches to float precision.)
    """
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "b", "learner.backend=deepspeed", "learner.zero_stage=3",
                 "run.steps=3", "data.prompts_per_step=3", "algorithm.ppo_epochs=2")
    killed = {}

    def kill(ctx, step, metrics):
        if step == 3:  # step 3 ran but was never checkpointed
            killed.update(metrics)
            raise Killed

    with pytest.raises(Killed):
        train(cfg, after_step=kill)
    with pytest.raises(RunStopped, match="run.resume=true"):  # never mixes into an existing run
        train(cfg)
    cfg.run.resume = True
    resumed = train(cfg)
    assert len(resumed) == 1
    timing = ("time/", "throughput/", "async/engine_busy", "async/learner_busy")  # wall-clock shares differ
    expected = {k: v for k, v in killed.items() if not k.startswith(timing)}
    got = {k: v for k, v in resumed[0].items() if not k.startswith(timing)}
    assert got.keys() == expected.keys() and "train/loss" in got
    for key, value in expected.items():
        tolerance = 1e-4 if key == "sync/logprob_gap" else 1e-5  # the probe gap is ~1e-7 noise
        assert got[key] == pytest.approx(value, rel=tolerance, abs=1e-6), key
    assert [m["step"] for m in read_metrics(tmp_path / "b")] == [1, 2, 3]


def test_resume_with_more_steps_keeps_the_lr_schedule_horizon(run_inputs, tmp_path):
    """A 1-step run with a linear decay to half the lr, resumed with run.steps=3: the
    schedule keeps its 1-step horizon (steps 2 and 3 train at the floor), instead of being
    stretched over 3 steps (step 3 would train at 2/3 of the way down: 0.667 × lr)."""
    root, model, data = run_inputs
    overrides = ("learner.backend=torch", "learner.zero_stage=0", "optim.schedule=linear", "optim.min_lr_ratio=0.5",
                 "rollout.mode=independent", "run.keep_checkpoints=1")
    (first,) = train(config(root, model, data, tmp_path / "e", "run.steps=1", *overrides))
    assert first["train/lr"] == pytest.approx(1e-2)
    resumed = train(config(root, model, data, tmp_path / "e", "run.steps=3", "run.resume=true", *overrides))
    assert [m["train/lr"] for m in resumed] == pytest.approx([5e-3, 5e-3])
    # run.keep_checkpoints=1: only the newest checkpoint stays.
    assert sorted(p.name for p in (tmp_path / "e" / "checkpoints").glob("step-*")) == ["step-000003"]


def kill_engine_mid_rollout(steps_to_hit):
    """An after_step hook that, from then on, SIGKILLs the run's engine server (by its pid)
    when the first tree of the steps in ``steps_to_hit`` is done: the other tree's requests
    are then in flight or about to be sent."""
    import os
    import signal

    import ray

    kills = []

    def arm(ctx, step, metrics):
        if kills or step + 1 not in steps_to_hit:
            return
        show = ctx.log.status
        worker = ctx.engines.workers[0]

        def status(text):
            if text.startswith("rollout: 1/") and len(kills) < len(steps_to_hit):
                pid = ray.get(worker.pid.remote())
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)
            show(text)

        ctx.log.status = status

    return arm, kills


def test_an_engine_killed_mid_rollout_is_restarted_and_the_step_completes(run_inputs, tmp_path):
    root, model, data = run_inputs
    # Two engines: the survivor must leave the old weight-update group for the next sync's new one.
    cfg = config(root, model, data, tmp_path / "f", "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "engine.num_engines=2")
    arm, kills = kill_engine_mid_rollout({2})
    versions = []

    def after_step(ctx, step, metrics):
        versions.append(ctx.run_async(ctx.client.get_weight_version()))
        arm(ctx, step, metrics)

    history = train(cfg, after_step=after_step)
    assert len(kills) == 1
    assert [m["engine/restarts"] for m in history] == [0, 1, 0]
    assert [m["rollout/trees"] for m in history] == [2, 2, 2]  # the killed step's trees all came back
    assert versions == [["1", "1"], ["2", "2"], ["3", "3"]]  # the restarted engine got the weights, the next syncs reached both
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)


def test_an_engine_killed_as_the_asynchronous_producer_samples_is_restarted_by_it(run_inputs, tmp_path, monkeypatch):
    root, model, data = run_inputs
    # Two engines: the survivor leaves the old weight-update group for the next push's new one.
    cfg = config(root, model, data, tmp_path / "ak", "learner.backend=torch", "learner.zero_stage=0", "run.steps=4",
                 "engine.num_engines=2", "algorithm.max_staleness=1", "run.sync_probe_every=1")
    kill = KillAtTheProducersRequest(monkeypatch, 3)  # after step 2, at step 3's first request
    history = train(cfg, after_step=kill.after_step)
    assert len(kill.kills) == 1 and len(history) == 4  # the run finished
    check_async_trained(history, max_staleness=1)
    # The producer restarted it while the trainer waited for step 3's batch.
    assert [m["engine/restarts"] for m in history] == [0, 0, 1, 0]
    assert [m["engine/stale_answers"] for m in history] == [0, 0, 0, 0]
    # Every push checks each engine's version: the restarted one took part in the later ones.
    assert [m["sync/weight_version"] for m in history] == [1, 2, 3, 4]
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)
    assert [m["async/dropped"] for m in history] == [0, 0, 0, 0]  # the restored engine served the pushed weights


def test_a_request_the_restarted_engine_answers_before_the_push_is_sent_again_after_it(run_inputs, tmp_path,
                                                                                      monkeypatch):
    """The race of the trainer's and the producer's threads, forced: the trainer, about to push
    step 2's weights, finds the server dead and restarts it; the restored server serves
    model.path's weights until that push, and the producer's request reaches it meanwhile (as a
    client's retry does). Its answer, labelled "default", is not used: the request is sent again
    after the push, so step 3's trees are not sampled by model.path's weights (and dropped as
    two updates old)."""
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "ar", "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "engine.num_engines=2", "algorithm.max_staleness=1", "run.sync_probe_every=1", "run.save_trees_every=1")
    kill = KillAtTheProducersRequest(monkeypatch, 3, by="trainer")
    history = train(cfg, after_step=kill.after_step)
    assert len(kill.kills) == 1 and len(history) == 3
    assert sum(m["engine/restarts"] for m in history) == 1
    assert [m["async/dropped"] for m in history] == [0, 0, 0]
    assert [m["rollout/trees_trained"] for m in history] == [2, 2, 2]
    trees = [RolloutTree.from_json(line) for line in (tmp_path / "ar" / "trees" / "step-000003.jsonl").read_text().splitlines()]
    assert {n.weight_version for t in trees for n in t.nodes()} - {None} <= {"1", "2"}
    assert sum(m["engine/stale_answers"] for m in history) == 1  # the one answer the restarted server gave before the push
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)


def test_lora_a_request_the_restarted_engine_refuses_before_its_restore_is_sent_again(run_inputs, tmp_path,
                                                                                     monkeypatch):
    """The race again, the producer's request reaching the restarted server before its restore:
    `arbor serve` refuses it (400: the adapter it names is not loaded yet). A refusal from a
    server under restore is not the request's fault: it is sent again once the server is
    restored and the push under way done."""
    root, model, data = run_inputs
    out = tmp_path / "lr"
    cfg = config(root, model, data, out, "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "engine.num_engines=2", "algorithm.max_staleness=1", "model.lora_rank=4", "run.save_trees_every=1")
    kill = KillAtTheProducersRequest(monkeypatch, 3, by="trainer", before="restore")
    history = train(cfg, after_step=kill.after_step)
    assert len(kill.kills) == 1 and len(history) == 3
    assert sum(m["engine/restarts"] for m in history) == 1
    assert [m["async/dropped"] for m in history] == [0, 0, 0]
    trees = [RolloutTree.from_json(line) for line in (out / "trees" / "step-000003.jsonl").read_text().splitlines()]
    assert {n.weight_version for t in trees for n in t.nodes()} - {None} <= {"1", "2"}
    assert sum(m["engine/stale_answers"] for m in history) == 1


def test_lora_with_an_asynchronous_producer_names_the_adapter_and_survives_an_engine_kill(run_inputs, tmp_path,
                                                                                          monkeypatch):
    """`arbor serve` answers 400 to a request that names no adapter once one is loaded: the
    producer's requests name the adapter of the last push, and a restarted engine gets the
    adapters the other holds back."""
    root, model, data = run_inputs
    out = tmp_path / "al"
    cfg = config(root, model, data, out, "learner.backend=torch", "learner.zero_stage=0", "run.steps=4",
                 "engine.num_engines=2", "algorithm.max_staleness=1", "run.sync_probe_every=1", "model.lora_rank=4", "run.save_trees_every=1")
    kill = KillAtTheProducersRequest(monkeypatch, 3)
    history = train(cfg, after_step=kill.after_step)
    assert len(kill.kills) == 1 and len(history) == 4
    check_async_trained(history, max_staleness=1)
    assert [m["engine/restarts"] for m in history] == [0, 0, 1, 0]
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)
    # Step 3's trees were sampled after the second push, by its adapter on the restarted server
    # (a base-model sample would have been refused).
    trees = [RolloutTree.from_json(line) for line in (out / "trees" / "step-000003.jsonl").read_text().splitlines()]
    assert {n.weight_version for t in trees for n in t.nodes()} - {None} == {"2"}
    # Adapters held: the newest 2 + max_staleness (requests in flight may name older ones).
    assert sorted(p.name for p in (out / "weight-sync").iterdir()) == ["arbor-lora-2", "arbor-lora-3", "arbor-lora-4"]


def test_an_engine_that_dies_during_a_push_from_disk_is_restarted_and_the_push_made_again(run_inputs, tmp_path,
                                                                                         monkeypatch):
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "pd", "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "engine.num_engines=2", "learner.weight_sync=disk", "run.sync_probe_every=1")
    kills = kill_after_the_health_check(monkeypatch, 2)
    history = train(cfg)
    assert len(kills) == 1 and len(history) == 3
    assert [m["engine/restarts"] for m in history] == [0, 1, 0]
    assert [m["sync/weight_version"] for m in history] == [1, 2, 3]  # both engines confirmed each push
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)


def test_an_engine_that_dies_during_a_broadcast_stops_the_run_naming_it(run_inputs, tmp_path, monkeypatch):
    from arbor.run.recovery import EngineFailedError

    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "pb", "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "learner.weight_sync=distributed")
    kills = kill_after_the_health_check(monkeypatch, 2)
    with pytest.raises(EngineFailedError, match=r"(?s)engine http://\S+ stopped answering during the push of weight "
                                                r"version 2 \(distributed\), which cannot be sent again.*step-000001: "
                                                r"continue with run.resume=true"):
        train(cfg)
    assert len(kills) == 1


def test_an_engine_that_keeps_dying_stops_the_run_with_its_log_and_checkpoint(run_inputs, tmp_path):
    from arbor.run.recovery import EngineFailedError

    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "g", "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "engine.max_restarts=0")
    arm, kills = kill_engine_mid_rollout({2})
    with pytest.raises(EngineFailedError, match=r"(?s)died 1 times .*engine.max_restarts=0.*step-000001: continue "
                                                r"with run.resume=true.*last lines of .*engine-0.log"):
        train(cfg, after_step=arm)
    assert len(kills) == 1 and (tmp_path / "g" / "checkpoints" / "latest").read_text() == "step-000001"


def test_a_lost_learner_rank_stops_the_run_naming_it_and_resume_continues(run_inputs, tmp_path):
    """Rank 1 of two is SIGKILLed (by its pid) at the end of step 2: saving step 2's
    checkpoint stops the run with an error naming rank 1 and step 1's checkpoint (still
    the latest, intact); run.resume=true redoes step 2 and finishes."""
    import os
    import signal

    import ray

    from arbor.run.learner_group import LearnerFailedError

    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "h", "learner.backend=deepspeed", "learner.zero_stage=3",
                 "learner.num_ranks=2", "run.steps=3")

    def kill_rank_1(ctx, step, metrics):
        if step == 2:
            os.kill(ray.get(ctx.learners.workers[1].pid.remote()), signal.SIGKILL)

    with pytest.raises(LearnerFailedError, match=r"learner rank 1 on node \S+ died .*step-000001: continue with run.resume=true"):
        train(cfg, after_step=kill_rank_1)
    cfg.run.resume = True
    resumed = train(cfg)
    assert len(resumed) == 2 and all(m["sync/logprob_gap"] <= 1e-4 for m in resumed)
    assert [m["step"] for m in read_metrics(tmp_path / "h")] == [1, 2, 3]


def test_a_reward_function_whose_workers_all_crash_stops_the_run(run_inputs, tmp_path):
    from arbor.rollout.rewards import RewardFailureError

    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "i", "learner.backend=torch", "learner.zero_stage=0",
                 f"reward.functions=[{{fn: {root}/coin_reward.py:crashes}}]")
    # One failure policy: every branch's check crashed, so every branch is dropped and the step
    # stops naming the first one.
    with pytest.raises(RewardFailureError, match=r"step 1: 8 of 8 episodes failed \(100% > reward.max_failure_fraction=0.1\)"
                                                 r"\. First: problem 'p\d+': reward_crash: the check's worker process died"):
        train(cfg)
    assert not (tmp_path / "i" / "metrics.jsonl").read_text()  # nothing was trained on the zeros


def test_plain_torch_learner_linear_loss_and_disk_sync(run_inputs, tmp_path):
    """The debugging set-up: one plain-torch rank, GRPO + linear training, weights via disk;
    colocated, so the engine releases its memory while the learner trains; two minibatches
    and a KL penalty to the frozen reference model."""
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "c", "learner.backend=torch", "learner.zero_stage=0",
                 "loss.mode=linear", "algorithm.advantage=grpo", "learner.weight_sync=disk", "run.steps=1",
                 "rollout.mode=independent", "ray.colocate=true", "algorithm.minibatches=2", "loss.kl_coef=0.01")
    versions = []
    (metrics,) = train(cfg, after_step=lambda ctx, step, m: versions.append(ctx.run_async(ctx.client.get_weight_version())))
    assert versions == [["1"]] and metrics["sync/logprob_gap"] <= 1e-4
    # Two minibatches, two updates; the second one sees a policy that moved away from the
    # frozen reference (the initial model), so the KL term is live.
    assert metrics["train/updates"] == 2 and metrics["train/kl"] > 0
    # Failures that would otherwise be silent are counted: here none happened.
    assert metrics["train/nonfinite_grad_norms"] == 0 and metrics["run/checkpoint_cleanup_failures"] == 0
    # Linear training counts every trajectory's tokens: nothing is shared, nothing saved.
    assert metrics["train/tokens"] == metrics["train/linearised_tokens"] > 0
    assert (tmp_path / "c" / "weight-sync" / "model.safetensors").exists()


def test_colocated_asynchronous_run_keeps_the_engine_serving(run_inputs, tmp_path):
    """ray.colocate with algorithm.max_staleness=1 (one GPU, sampling while training): the engine
    keeps its memory, since a released embedded engine refuses requests (EngineReleased), and
    the producer samples step 2's trees while step 1 trains."""
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "ca", "learner.backend=torch", "learner.zero_stage=0",
                 "learner.weight_sync=disk", "ray.colocate=true", "algorithm.max_staleness=1", "run.sync_probe_every=1", "run.steps=3")
    history = train(cfg)
    assert [m["rollout/trees"] for m in history] == [2, 2, 2]
    assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)
    check_async_trained(history, max_staleness=1)  # the producer sampled while the learner trained


def test_external_engines_serve_a_run(run_inputs, tmp_path):
    """engine.kind: external: the run adopts a server it did not start (and leaves it running)."""
    from arbor.engines.launch import launch_engines

    root, model, data = run_inputs
    with launch_engines("embedded", model_path=str(model), device="cpu", log_dir=tmp_path / "logs",
                        startup_timeout_s=120) as server:
        cfg = config(root, model, data, tmp_path / "x", "learner.backend=torch", "learner.zero_stage=0",
                     "engine.kind=external", f"engine.urls=[{server.urls[0]}]")
        history = train(cfg)
        assert len(history) == 2 and all(m["rollout/trees"] == 2 for m in history)
        assert all(m["sync/logprob_gap"] <= 1e-4 for m in history)
        assert server.processes[0].poll() is None  # still serving: the run stops only what it started


def test_quickstart_command_runs(tmp_path):
    """`arbor train configs/quickstart.yaml`, shortened: the README's main command stays runnable."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "qs"
    command = [sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", "run.steps=2", "run.eval_every=2",
               "data.prompts_per_step=4", f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2/2" in done.stdout and "eval acc" in done.stdout
    logged = read_metrics(out)
    assert [m["step"] for m in logged] == [0, 1, 2] and "eval/accuracy" in logged[0]
    # Step 2 evaluated: its throughput is the training's, over the step's time without the eval.
    last = logged[2]
    assert last["time/eval_s"] > 0
    working = sum(v for k, v in last.items() if k.startswith("time/") and k not in ("time/step_s", "time/eval_s"))
    assert last["throughput/tokens_per_s"] == pytest.approx(last["rollout/tokens_generated"] / working)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(out / "hf")  # the HF export loads as a model
    assert exported.config.model_type == "qwen2" and AutoTokenizer.from_pretrained(out / "hf").eos_token == "<|im_end|>"
    assert (out / "checkpoints" / "latest").read_text() == "step-000002"


def test_joins_a_ray_cluster_and_spreads_learner_ranks(run_inputs, tmp_path):
    """`ray.address` joins a running cluster (two nodes here, on one machine); ranks spread
    over the nodes find each other through rank 0's node address, engines bind theirs."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a local instance of an earlier test
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        root, model, data = run_inputs
        cfg = config(root, model, data, tmp_path / "d", f"ray.address={cluster.address}", "learner.num_ranks=2",
                     "ray.placement_strategy=SPREAD", "run.steps=1")
        nodes = []

        def check(ctx, step, metrics):
            placement = ray.util.placement_group_table(ctx.placement.group)
            nodes.extend(placement["bundles_to_node_id"].values())
            assert metrics["sync/logprob_gap"] <= 1e-4

        train(cfg, after_step=check)
        assert len(set(nodes)) == 2  # the three bundles (2 learner ranks, 1 engine) use both nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_multi_turn_agent_episodes_train(tmp_path):
    """rollout.agent: two-turn episodes on the quickstart model; tool turns are untrained
    context, counted per episode, and their errors are counted."""
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs" / "quickstart.yaml", [
        f"run.output_dir={tmp_path / 'out'}", "run.steps=1", "run.eval_every=0", "data.prompts_per_step=4",
        "learner.backend=torch", "learner.zero_stage=0", f"rollout.agent={repo}/tests/agent_fixtures.py:Recheck",
        "rollout.width=4", "rollout.max_depth=6", "algorithm.dynamic_sampling=false",
    ])
    (metrics,) = train(cfg)
    # The tiny model ends its answer with <|im_end|> almost always: one tool turn per episode.
    assert 0.5 < metrics["agent/tool_calls_per_episode"] <= 1.0
    assert metrics["agent/tool_errors"] > 0 and metrics["agent/unsandboxed_tool_calls"] == 0
    assert metrics["train/linearised_tokens"] > 0 and metrics["sync/logprob_gap"] <= 1e-4


def test_a_too_small_local_ray_instance_is_restarted_or_refused():
    """A run needing more CPUs than the process's running Ray instance: arbor restarts an
    instance it started itself (an earlier, smaller run) and refuses one the user started,
    instead of waiting 600 s for a placement that cannot happen."""
    import ray

    from arbor.config import RayConfig
    from arbor.run import orchestration

    ray.shutdown()
    try:
        orchestration.start_ray(RayConfig(), needs_cpus=1)
        small = ray.cluster_resources()["CPU"]
        needs = int(small) + 2
        orchestration.start_ray(RayConfig(), needs_cpus=needs)
        assert ray.cluster_resources()["CPU"] == needs
        ray.shutdown()
        # address="local": a new instance even when another cluster runs on the machine.
        ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False)
        orchestration._started_here = False  # as after a user's own ray.init
        with pytest.raises(RuntimeError, match=f"has 1 CPUs but this run places {needs}"):
            orchestration.start_ray(RayConfig(), needs_cpus=needs)
        assert ray.is_initialized()  # the user's instance was left alone and ray.cluster_resources()["CPU"] == 1
    finally:
        ray.shutdown()


def test_async_run_with_a_sequence_level_mis_correction(run_inputs, tmp_path):
    """loss.rollout_correction on an off-policy run: π_old recomputed before each update, each
    leaf's weight (linear chains here) in place of the decoupled objective's truncation."""
    root, model, data = run_inputs
    cfg = config(root, model, data, tmp_path / "mis", "learner.backend=torch", "learner.zero_stage=0",
                 "algorithm.max_staleness=1", "run.sync_probe_every=1", "loss.mode=linear", "loss.rollout_correction=mis",
                 "loss.rollout_correction_level=sequence", "loss.rollout_mask_bounds=[0.9, 1.1]", "run.steps=3")
    history = train(cfg)
    check_async_trained(history, max_staleness=1)
    for metrics in history:
        assert "train/behaviour_weight" not in metrics  # the correction, not behaviour_cap, weighted it
        assert metrics["mismatch/kl"] >= 0 and metrics["mismatch/is_weight_max"] >= metrics["mismatch/is_weight_mean"] > 0
        assert 0 <= metrics["mismatch/masked_fraction"] <= 1
    # The first batch was sampled by the weights that train it: float32 on both sides, no mismatch.
    assert history[0]["mismatch/kl"] < 1e-6 and history[0]["mismatch/masked_fraction"] == 0


def test_async_run_keeps_the_staleness_bound_and_resumes_without_samples_in_flight(run_inputs, tmp_path):
    root, model, data = run_inputs
    out = tmp_path / "async"
    cfg = config(root, model, data, out, "learner.backend=torch", "learner.zero_stage=0", "run.steps=3",
                 "algorithm.max_staleness=1", "run.save_trees_every=1")
    seen = {}

    def kill(ctx, step, metrics):
        seen[step] = metrics
        if step == 2:  # step 2 ran but was never checkpointed; batch 3 was being sampled
            raise Killed

    with pytest.raises(Killed):
        train(cfg, after_step=kill)
    for metrics in seen.values():
        assert metrics["async/dropped"] == 0 and 0 <= metrics["async/staleness_mean"] <= 1
        assert 0 <= metrics["async/engine_busy"] <= 1 and 0 < metrics["async/learner_busy"] <= 1
        assert metrics["train/behaviour_weight"] > 0  # the decoupled objective trained it
    assert seen[1]["async/staleness_mean"] == 0  # the first batch was sampled by the weights that train it
    # Batch 2 was sampled while step 1 trained: one update old, and trained (not dropped).
    assert seen[2]["async/staleness_mean"] == 1 and seen[2]["rollout/trees_trained"] == 2
    # run.sync_probe_every's asynchronous default: the run's first step, then every 10th.
    assert seen[1]["sync/logprob_gap"] <= 1e-4 and "sync/logprob_gap" not in seen[2]
    # The checkpoint of step 1 points at the problems of batch 2, though the producer had gone past them.
    state = checkpoint.read_driver_state(checkpoint.latest_checkpoint(out))
    assert state["step"] == 1 and state["stream"] == {"epoch": 0, "cursor": 2}
    trees = [RolloutTree.from_json(line) for line in (out / "trees" / "step-000001.jsonl").read_text().splitlines()]
    assert {n.weight_version for t in trees for n in t.nodes()} == {"default"}  # sampled before any push

    cfg.run.resume = True
    resumed = train(cfg)
    assert len(resumed) == 2 and all(m["async/staleness_mean"] <= 1 for m in resumed)
    assert "sync/logprob_gap" in resumed[0] and "sync/logprob_gap" not in resumed[1]  # the resumed run's first step
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 2, 3]  # step 2 redone after the kill
    state = checkpoint.read_driver_state(checkpoint.latest_checkpoint(out))
    assert state["step"] == 3 and state["stream"] == {"epoch": 0, "cursor": 6}
