"""configs/agent_math.yaml: the Python-tool agent on models/tiny-arith-tool,
one short real run, and scripts/build_tool_model.py's warm-up in the episodes' format."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

from arbor.config_load import load_config
from arbor.data import read_rows
from arbor.rollout.agents import episode_inputs, load_agent
from arbor.run.sft import encode_example
from arbor.run.trainer import train
from arbor.tree import RolloutTree

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "agent_math.yaml"
MODEL = REPO / "models" / "tiny-arith-tool"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_tool_model", REPO / "scripts/build_tool_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_math_run_calls_the_tool_and_logs_tool_errors(tmp_path):
    """One step of the config, on 4 problems: the warm-started model writes code in most
    episodes, and TensorBoard holds both agent metrics (the errors even when 0)."""
    out = tmp_path / "out"
    cfg = load_config(
        CONFIG,
        [
            f"run.output_dir={out}",
            "run.steps=1",
            "run.eval_every=0",
            "data.prompts_per_step=4",
            "learner.backend=torch",
            "learner.zero_stage=0",
            "algorithm.dynamic_sampling=false",
            "run.save_trees_every=1",
            "algorithm.max_staleness=0",  # one step: the asynchronous run is the last test below
        ],
    )
    (metrics,) = train(cfg)
    # ~0.95 measured; a model that never wrote a ```python block would give 0.
    assert metrics["agent/tool_calls_per_episode"] >= 0.5
    assert metrics["train/linearised_tokens"] > 0
    # The step's 4 trees, saved: each tool call is one node of the model's none (a shared
    # one once), and a failed call's message says "Error: the code ..." (arbor.rollout.tools).
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    trees = [RolloutTree.from_json(line) for line in (out / "trees" / "step-000001.jsonl").read_text().splitlines()]
    tool_turns = [tokenizer.decode(node.token_ids) for tree in trees for node in tree.nodes()
                  if node.loss_mask and not any(node.loss_mask)]
    assert len(trees) == 4 and tool_turns
    assert metrics["agent/tool_errors"] == sum("Error: the code" in turn for turn in tool_turns), tool_turns
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    scalars = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"agent/tool_calls_per_episode", "agent/tool_errors"} <= set(scalars), scalars


def test_warm_up_conversations_are_the_episodes_arbor_train_samples():
    """The SFT conversation's ids are the episode's: the prompt `arbor train` starts it
    with, the code turn and its EOS, the tool turn as the sampler appends it (loss mask 0),
    the answer; and it fits the config's response budget and the model's context."""
    script = _script()
    cfg = load_config(CONFIG, [])
    assert (
        script.AGENT == cfg.rollout.agent
        and script.MAX_RESPONSE_TOKENS == cfg.rollout.max_response_tokens
    )
    assert script.DATA_CFG.system_prompt == cfg.data.system_prompt
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    agent = load_agent(script.AGENT, "rollout.agent", [str(REPO)])
    problem = {"id": "p", "prompt": "What is 21-9?", "answer": "12"}
    messages = script.conversation(agent, problem)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == "12\n"  # the sandbox's own output of print(21-9)

    (prompt,), render = episode_inputs(
        [problem], agent, tokenizer, cfg.data, cfg.model.chat_template
    )
    eos = tokenizer.eos_token_id
    code = tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"] + [eos]
    tool = render(messages[2:3])
    answer = tokenizer(messages[3]["content"], add_special_tokens=False)["input_ids"] + [eos]
    example = encode_example(
        {"messages": messages}, "p", tokenizer, script.DATA_CFG, True, max_tokens=256
    )
    (leaf,) = example.tree.leaves()
    ids = example.tree.response_ids(leaf)
    mask = [m for node in example.tree.path(leaf) for m in node.loss_mask]
    episode = code + tool + answer
    assert example.tree.prompt_ids == prompt
    assert ids[: len(episode)] == episode  # then the template's newline after the last EOS
    assert mask == [1] * len(code) + [0] * len(tool) + [1] * len(answer) + [0] * (
        len(ids) - len(episode)
    )
    assert len(episode) <= cfg.rollout.max_response_tokens
    assert len(prompt) + cfg.rollout.max_response_tokens <= 256  # max_position_embeddings

    # The committed conversations are the script's for data/arith's SFT split (after the validation slice).
    problems = [row for _, row in read_rows(REPO / "data" / "arith" / "sft.jsonl")]
    committed = [row for _, row in read_rows(REPO / "data" / "arith-tool" / "sft.jsonl")]
    assert len(committed) == len(problems) - 100
    for row, problem in zip(committed[:3], problems[100:]):
        assert row == {"id": problem["id"], "messages": script.conversation(agent, problem)}


def test_build_tool_model_writes_a_loadable_model(tmp_path):
    """A few steps on 12 problems: the model directory loads, with the base's tokenizer files."""
    problems = tmp_path / "problems.jsonl"
    rows = [row for _, row in read_rows(REPO / "data" / "arith" / "sft.jsonl")][:12]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, data = tmp_path / "model", tmp_path / "data"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/build_tool_model.py"),
            "--problems",
            str(problems),
            "--test",
            str(problems),
            "--val-problems",
            "4",
            "--steps",
            "3",
            "--batch",
            "4",
            "--eval-every",
            "2",
            "--eval-problems",
            "4",
            "--eval-samples",
            "2",
            "--out",
            str(out),
            "--data",
            str(data),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(
        r"^RESULT tool_use=[\d.]+ tool_errors=[\d.]+ sampled_acc=[\d.]+ greedy_acc=[\d.]+ "
        r"params=\d+ build_s=\d+$",
        run.stdout,
        re.M,
    ), run.stdout[-2000:]
    assert len((data / "sft.jsonl").read_text().splitlines()) == 8
    base = REPO / "models" / "tiny-arith"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.eos_token_id == AutoTokenizer.from_pretrained(out).eos_token_id


def test_the_tool_agent_trains_asynchronously(tmp_path):
    """The stateless Python-tool agent under algorithm.max_staleness=1: its tool turns carry no
    weight version, so its trees are as old as their sampled turns, and every step from the second
    trains (a tool turn read as version 0 made every tree too stale from step 3 on)."""
    from async_checks import check_async_trained

    cfg = load_config(CONFIG, [
        f"run.output_dir={tmp_path / 'async'}", "run.steps=3", "run.eval_every=0", "data.prompts_per_step=4",
        "learner.backend=torch", "learner.zero_stage=0", "algorithm.dynamic_sampling=false",
        "algorithm.max_staleness=1",
    ])
    history = train(cfg)
    check_async_trained(history, max_staleness=1)
    assert all(m["agent/tool_calls_per_episode"] > 0 and m["async/dropped"] == 0 for m in history)
