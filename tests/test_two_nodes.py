"""``arbor train`` across two node addresses: 10.77.0.1 (Ray head, driver) and 10.77.0.2 (a Ray worker).

Built by scripts/two_node_cluster.sh (tests/netns_cluster.py): two network namespaces on a
private bridge, each node's processes in a PID namespace of its own; interfaces are named
differently on each node and the host name resolves to loopback, so a rank that advertised a
host-name address or copied the driver's interface would fail here as on a real cluster.
Placement is pinned with custom resources (``ray.learner_resources``, ``ray.engine_resources``):

- node 1: CPU 4, ``{node1: 3, trainer: 1}``; node 2: CPU 3, ``{trainer: 1, rollout: 1}``.
- ``SPLIT``: learner rank 0 on node 1 (the driver's: ranks are numbered from its node), rank 1
  and the engine on node 2 (ZeRO-3 over gloo across the addresses; weights broadcast from
  10.77.0.1 to 10.77.0.2 or loaded from disk).
- ``ONE_NODE``: everything on node 1, the same run for comparison.

One cluster for the module; a test that kills node 2 starts it again for the next.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from netns_cluster import namespace_cluster, node_env
from test_sft import write_config
from tiny_model import build_tiny_model_dir
from transformers import AutoModelForCausalLM

from arbor.config_load import load_config
from arbor.engines.ports import free_port
from arbor.run.metrics import read_metrics
from arbor.run.sft import run_sft

QUICK = ["learner.num_ranks=2", "run.eval_every=0", "run.save_trees_every=0", "run.cpu_threads=1",
         "data.prompts_per_step=16", "algorithm.max_refill_rounds=1"]
SPLIT = ["ray.learner_resources={trainer: 1}", "ray.engine_resources={rollout: 1}"]
ONE_NODE = ["ray.learner_resources={node1: 1}", "ray.engine_resources={node1: 1}"]
GAP_BOUND = 1e-5  # float32 learner and embedded engine: the same forward, up to summation order


@pytest.fixture(scope="module")
def cluster():
    cluster = namespace_cluster(nodes=2)
    try:
        cluster.start_ray(1, cpus=4, resources={"node1": 3, "trainer": 1})
        cluster.start_ray(2, cpus=3, resources={"trainer": 1, "rollout": 1})
        yield cluster
    finally:
        cluster.down()


def train_command(cluster, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", f"ray.address={cluster.ray_address}",
            f"run.output_dir={out}", *QUICK, "algorithm.max_staleness=0", *overrides]


def train(cluster, out: Path, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    done = cluster.run(1, train_command(cluster, out, *overrides), timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def started_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("arbor train: quickstart, steps"))


def steps_of(out: Path) -> list[dict]:
    return [m for m in read_metrics(out) if m["step"] >= 1]


def test_ranks_on_two_addresses_learn_as_on_one_node(cluster, tmp_path):
    """Weights by broadcast from rank 0 (10.77.0.1) to the engine (10.77.0.2); the same run on
    one node gives the same trees, rewards and losses (same seed), and both keep the engine's
    log-probs the learner's."""
    # An entropy bonus makes the loss a per-step value (-0.01 x the entropy, ~1e-3): the PPO
    # objective alone is ~1e-8 on fresh samples (advantages average to 0), float noise apart.
    entropy = "loss.entropy_coef=0.01"
    split = train(cluster, tmp_path / "split", *SPLIT, "run.steps=2", entropy)  # step 2: on broadcast weights
    one = train(cluster, tmp_path / "one", *ONE_NODE, "run.steps=2", entropy)
    a, b = cluster.address(1), cluster.address(2)
    assert f"engines http://{b}:" in started_line(split.stdout), started_line(split.stdout)
    assert f"2 learner rank(s) on {a}, {b}," in started_line(split.stdout)  # rank 0 beside the driver
    assert f"engines http://{a}:" in started_line(one.stdout) and f"on {a}, {a}," in started_line(one.stdout)

    two_nodes, one_node = steps_of(tmp_path / "split"), steps_of(tmp_path / "one")
    assert [m["step"] for m in two_nodes] == [m["step"] for m in one_node] == [1, 2]
    for x, y in zip(two_nodes, one_node):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-9), (x, y)
        assert x["train/tokens"] == y["train/tokens"] and x["train/linearised_tokens"] == y["train/linearised_tokens"]
        assert abs(x["train/loss"]) > 1e-4  # the bonus's share, 1e4 x the objective's: a loss off by 1e-3 fails
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5), (x["train/loss"], y["train/loss"])
        assert x["train/entropy"] == pytest.approx(y["train/entropy"], rel=1e-5)
        assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-4)
        assert x["sync/logprob_gap"] < GAP_BOUND and y["sync/logprob_gap"] < GAP_BOUND
        assert x["train/logprob_gap"] < GAP_BOUND
    # Indicative only (a loaded machine): seconds per step after the first, two nodes vs one.
    print("time/step_s two nodes", [round(m["time/step_s"], 2) for m in two_nodes],
          "one node", [round(m["time/step_s"], 2) for m in one_node])


def start_train(cluster, out: Path, *overrides: str) -> subprocess.Popen:
    """``arbor train`` on node 1 in the background, its output in ``out``.stdout / .stderr."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return cluster.popen(1, train_command(cluster, out, *overrides),
                         stdout=open(f"{out}.stdout", "w"), stderr=open(f"{out}.stderr", "w"))  # noqa: SIM115


def wait_for_step(process: subprocess.Popen, out: Path, step: int, timeout: float = 600) -> None:
    """Until step ``step`` is written to ``out``'s metrics (and, with checkpoints, named latest)."""
    deadline = time.monotonic() + timeout
    while not any(m["step"] == step for m in (read_metrics(out) if (out / "metrics.jsonl").exists() else [])):
        assert process.poll() is None, f"the run exited {process.returncode}:\n{Path(f'{out}.stderr').read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout:.0f} s"
        time.sleep(0.5)


def finish(process: subprocess.Popen, out: Path, timeout: float = 600) -> tuple[int, str, str]:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, Path(f"{out}.stdout").read_text(), Path(f"{out}.stderr").read_text()


def test_weights_by_disk_a_lost_node_stops_the_run_naming_it_and_resume_continues(cluster, tmp_path):
    """Node 2 (learner rank 1 and the engine) dies after step 2's checkpoint: the run stops
    naming the rank, its node and that checkpoint; with node 2 back, run.resume=true finishes."""
    out = tmp_path / "lost"
    run = [*SPLIT, "learner.weight_sync=disk", "run.steps=4", "run.save_every=1"]
    process = start_train(cluster, out, *run)
    try:
        wait_for_step(process, out, 2)
        deadline = time.monotonic() + 120
        while (out / "checkpoints" / "latest").read_text().strip() != "step-000002":
            assert time.monotonic() < deadline, "no checkpoint of step 2"
            time.sleep(0.2)
        cluster.kill(2)
        code, stdout, stderr = finish(process, out, timeout=300)
    finally:
        cluster.restart(2)
    b = cluster.address(2)
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    stopped = next((line for line in stderr.splitlines() if line.startswith("arbor train: stopped:")), stderr[-3000:])
    assert f"learner rank 1 on node {b} (the node is lost: Ray lists it as dead) died" in stopped, stopped
    assert f"The last checkpoint is {out.resolve()}/checkpoints/step-000002: continue with run.resume=true" in stopped
    assert all(m["sync/logprob_gap"] < GAP_BOUND for m in steps_of(out))

    resumed = train(cluster, out, *run, "run.resume=true")
    assert f"resumed from {out.resolve()}/checkpoints/step-000002 (step 2)" in resumed.stdout
    assert [m["step"] for m in steps_of(out)] == [1, 2, 3, 4]
    assert all(m["sync/logprob_gap"] < GAP_BOUND for m in steps_of(out))


HOLD_AFTER_STEP_1 = '''
import json
import time
from pathlib import Path


def after_step_1(problem, completion):
    """0.0; once step 1's metrics are written, only after the test's release file exists."""
    metrics = Path("{metrics}")
    if metrics.exists() and any(json.loads(line).get("step") == 1 for line in metrics.read_text().splitlines() if line.strip()):
        deadline = time.monotonic() + 240
        while not Path("{released}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0.0
'''


def test_an_engine_alone_on_a_lost_node_starts_again_on_an_alive_one(cluster, tmp_path):
    """Both learner ranks on node 1, the engine on node 2 (SPREAD: a node the group does not use
    yet); node 2 dies after step 1: the engine starts again on node 1 with the run's weights,
    and the run finishes step 2 there."""
    out, released = tmp_path / "moved", tmp_path / "released"
    # A barrier, not a timing window: a reward term (weight 0) holds step 2's checks until the
    # node is dead, so the run needs its engine again after the kill (at step 2's push).
    (tmp_path / "hold.py").write_text(HOLD_AFTER_STEP_1.format(metrics=out / "metrics.jsonl", released=released))
    process = start_train(cluster, out, "ray.learner_resources={node1: 1}", "ray.placement_strategy=SPREAD",
                          "run.steps=2", "reward.timeout_s=300",
                          f"reward.functions=[{{fn: rewards/math.py:boxed_accuracy, weight: 1.0}}, "
                          f"{{fn: {tmp_path / 'hold.py'}:after_step_1, weight: 0.0}}]")
    a, b = cluster.address(1), cluster.address(2)
    try:
        wait_for_step(process, out, 1)
        assert f"engines http://{b}:" in started_line(Path(f"{out}.stdout").read_text())
        cluster.kill(2)
        released.touch()
        code, stdout, stderr = finish(process, out)
    finally:
        cluster.restart(2)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert f"now runs at http://{a}:" in stderr, stderr[-3000:]
    steps = steps_of(out)
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["engine/restarts"] for m in steps] == [0, 1]
    assert all(m["sync/logprob_gap"] < GAP_BOUND for m in steps)


def test_sft_by_deepspeeds_launcher_on_both_nodes_equals_one_process(cluster, tmp_path):
    """``deepspeed --no_ssh --node_rank=K`` on each node (a hostfile of both addresses, the
    rendezvous at node 1's): two ZeRO-3 ranks over gloo across the addresses give the one-process
    run's loss and gradient norm at every step, and its weights."""
    tiny = build_tiny_model_dir(tmp_path / "tiny")
    config = write_config(tmp_path, tiny, "")
    steps = ["sft.max_steps=3", "run.loggers=[]"]
    a, b = cluster.address(1), cluster.address(2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{a} slots=1\n{b} slots=1\n")
    launcher = Path(sys.executable).with_name("deepspeed")
    port = free_port("")
    ranks = [cluster.popen(node, [launcher, "--hostfile", hostfile, "--no_ssh", f"--node_rank={node - 1}",
                                  f"--master_addr={a}", f"--master_port={port}", "--module", "arbor", "sft", config,
                                  *steps], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for node in (1, 2)]
    logs = [rank.communicate(timeout=600)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "2 rank(s), DeepSpeed ZeRO-3" in logs[0] and "step 3/3" in logs[0]

    two = read_metrics(tmp_path / "run")
    one = run_sft(load_config(config, ["learner.backend=torch", f"run.output_dir={tmp_path / 'single'}", *steps]))
    assert [m["sft/loss"] for m in two] == pytest.approx([m["sft/loss"] for m in one], rel=1e-5)
    assert [m["sft/grad_norm"] for m in two] == pytest.approx([m["sft/grad_norm"] for m in one], rel=1e-5)
    across = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").state_dict()
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "hf").state_dict()
    for name, tensor in single.items():
        torch.testing.assert_close(across[name], tensor, rtol=1e-4, atol=1e-6)


def test_arbor_eval_against_an_engine_on_the_other_node(cluster, tmp_path):
    """``arbor serve`` bound to node 2's address, with a key; ``arbor eval`` on node 1 uses it
    as an external engine."""
    b = cluster.address(2)
    port = free_port("")
    key = "two-node-test-key"
    env = node_env(ARBOR_ENGINE_API_KEY=key)
    server = cluster.popen(2, [sys.executable, "-m", "arbor", "serve", "--model", "models/tiny-arith", "--host", b,
                               "--port", port, "--dtype", "float32", "--device", "cpu"], env=env,
                           stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        report = tmp_path / "eval.json"
        done = cluster.run(1, [sys.executable, "-m", "arbor", "eval", "configs/quickstart.yaml", "engine.kind=external",
                               f"engine.urls=[http://{b}:{port}]", "engine.startup_timeout_s=300",
                               "eval.max_problems=16", f"eval.output={report}", f"run.output_dir={tmp_path / 'eval'}"],
                           env=env, timeout=600)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-2000:]
    assert f"arbor eval: engines http://{b}:{port}" in done.stdout
    result = json.loads(report.read_text())
    assert len(result["problems"]) == 16
    # Greedy, one answer per problem: the accuracy is the share of answers that are the gold
    # one, read back from the records; the starting model gets some right (~0.3).
    samples = [(str(p["gold"]), s) for p in result["problems"] for s in p["samples"]]
    assert result["metrics"]["eval/accuracy"] == sum(s["answer"] == gold for gold, s in samples) / 16 > 0


def test_a_placement_that_cannot_fit_fails_at_once(cluster, tmp_path):
    """STRICT_SPREAD puts each of 3 bundles on its own node; the cluster has 2: stop at start-up."""
    started = time.monotonic()
    done = cluster.run(1, train_command(cluster, tmp_path / "run", "ray.placement_strategy=STRICT_SPREAD", "run.steps=1"),
                       timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("arbor train: stopped: Ray cannot place this run: ray.placement_strategy=STRICT_SPREAD puts each of the 3 "
            "bundles (learner rank 0, learner rank 1, engine 0) on a node of its own, and the cluster has 2 alive "
            "nodes") in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 300  # it used to wait 600 s for the placement


def test_a_node_without_the_model_or_the_output_dir_fails_naming_it(cluster, tmp_path):
    """model.path and run.output_dir exist on node 1 only (node 2 sees an empty file system
    there): the run stops at start-up naming node 2 and both keys."""
    import shutil

    hidden = tmp_path / "node1-only"
    model = hidden / "model"
    shutil.copytree(Path(__file__).resolve().parents[1] / "models" / "tiny-arith", model)
    cluster.run(2, ["mount", "-t", "tmpfs", "tmpfs", hidden], check=True)
    try:
        done = cluster.run(1, train_command(cluster, hidden / "run", *SPLIT, f"model.path={model}", "run.steps=1"),
                           timeout=600)
    finally:
        cluster.run(2, ["umount", hidden], check=True)
    b = cluster.address(2)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    error = next((line for line in done.stderr.splitlines() if line.startswith("arbor train: config error:")),
                 done.stderr[-3000:])
    assert f"on node {b}: model.path {model} does not exist there" in error, error
    assert f"run.output_dir {hidden / 'run'} there is not the driver's" in error, error


@pytest.mark.parametrize("weight_sync", ["distributed", "disk"])
def test_a_real_sglang_server_on_the_other_node(cluster, tmp_path, weight_sync):
    """SGLang (its CPU engine) started by arbor on node 2, learner ranks on both nodes: weights
    broadcast from 10.77.0.1 into SGLang's own weight-update group on 10.77.0.2, or loaded by
    SGLang from the directory rank 0 writes."""
    from sglang_env import sglang_python

    python = sglang_python()
    out = tmp_path / "sglang"
    done = train(cluster, out, *SPLIT, "engine.kind=sglang", f"engine.python={python}", "engine.max_cached_tokens=16384",
                 f"learner.weight_sync={weight_sync}", "data.prompts_per_step=4", "run.steps=2", "run.save_every=0")
    assert f"engines http://{cluster.address(2)}:" in started_line(done.stdout)
    steps = steps_of(out)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["sync/logprob_gap"] < 1e-4 for m in steps)  # SGLang's torch_native kernels vs the learner
    assert steps[0]["train/logprob_gap"] < 1e-4
