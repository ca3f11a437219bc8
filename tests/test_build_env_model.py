"""scripts/build_env_model.py: the adapter configs' model, warmed up on episodes played
against the real environments and rendered as ``arbor train`` renders them."""

from __future__ import annotations

import json
import subprocess
import sys

from adapter_packages import require
from script_loader import REPO, load_script

for module, extra in (("textarena", "textarena"), ("mcp", "mcp"), ("verifiers", "verifiers"), ("openenv", "openenv"),
                      ("reasoning_gym", "reasoning-gym")):
    require(module, extra)


def test_an_episode_is_rendered_as_arbor_train_samples_it():
    """Prompt (with the tools), the model's turn + EOS (trained), the environment's answer as
    continuation ids (not trained): the ids the sampler builds for the same turns."""
    from transformers import AutoTokenizer

    from arbor.data import chat_template_ids
    from arbor.rollout.agents import continuation_ids

    script = load_script("build_env_model")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-env")
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {}}}]
    start = [{"role": "user", "content": "What is stored under k1?"}]
    answer = [{"role": "tool", "content": "v0"}]
    ids, mask = script.Renderer(tokenizer).episode(start, tools, [("<tool_call>x</tool_call>", answer), ("done", [])])
    prompt = chat_template_ids(tokenizer, start, generation_prompt=True, tools=tools)
    call = tokenizer("<tool_call>x</tool_call>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tool = continuation_ids(tokenizer, answer)
    done = tokenizer("done", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == prompt + call + tool + done
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(done)
    assert '"name": "lookup"' in tokenizer.decode(prompt)  # the template lists the tools


def test_a_short_build_writes_a_loadable_model_and_the_configs_problems(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, data = tmp_path / "model", tmp_path / "data"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "build_env_model.py"), "--steps", "2",
                          "--episodes", "3", "--batch", "2", "--out", str(out), "--data", str(data)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1].startswith("RESULT steps=2 ")
    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == (REPO / "models" / "tiny-env" / "chat_template.jinja").read_text()
    for name in ("guess.jsonl", "keypad.jsonl", "lookup.jsonl", "lookup_verifiers.jsonl"):
        rows = [json.loads(line) for line in (data / name).read_text().splitlines()]
        assert rows == [json.loads(line) for line in (REPO / "data" / "env" / name).read_text().splitlines()]
