"""scripts/build_tiny_model.py makes a model directory transformers loads, and problem files."""

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]


def test_builder_writes_loadable_model_and_data(tmp_path):
    out, data = tmp_path / "model", tmp_path / "data"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/build_tiny_model.py"), "--steps", "3", "--batch", "4",
         "--eval-problems", "2", "--out", str(out), "--data", str(data)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "greedy accuracy on 2 held-out problems" in run.stdout
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer("What is 37+48? \\boxed{85}")["input_ids"]) == "What is 37+48? \\boxed{85}"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=False)
    assert ids.endswith("<|im_start|>assistant\n")
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 3800 and set(rows[0]) == {"id", "prompt", "answer"}
    a, op, b = rows[0]["prompt"].removeprefix("What is ").removesuffix("?").partition("+" if "+" in rows[0]["prompt"] else "-")
    assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == rows[0]["answer"]
