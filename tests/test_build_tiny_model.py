"""scripts/build_tiny_model.py makes a model directory transformers loads, and problem files."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from arbor.config import DataConfig
from arbor.data import format_prompt

REPO = Path(__file__).resolve().parents[1]
# What configs/quickstart.yaml sets: model.chat_template true, no system prompt, this suffix.
QUICKSTART_SUFFIX = " Put the answer in \\boxed{}."


def _script():
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts/build_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_builder_writes_loadable_model_and_data(tmp_path):
    out, data = tmp_path / "model", tmp_path / "data"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/build_tiny_model.py"), "--steps", "30", "--batch", "8",
         "--hidden", "64", "--layers", "2", "--eval-every", "1000", "--val-problems", "4",
         "--eval-problems", "4", "--eval-samples", "2", "--out", str(out), "--data", str(data)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, re.search(r"loss: first ([\d.]+) last ([\d.]+)", run.stdout).groups())
    assert last < 0.7 * first, run.stdout
    assert re.search(r"^RESULT sampled_acc=[\d.]+ greedy_acc=[\d.]+ params=\d+ build_s=\d+$", run.stdout, re.M)

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    text = "What is 37+48? \\boxed{85}"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]  # digits one per token

    # The SFT prompts are exactly what `arbor train` feeds the policy with the quickstart's data config.
    script = _script()
    assert script.PROMPT_SUFFIX == QUICKSTART_SUFFIX
    problem = {"id": "p", "prompt": "What is 37+48?", "answer": "85", "solution": "37+48=85 \\boxed{85}"}
    rl_ids = format_prompt(problem, DataConfig(prompt_suffix=QUICKSTART_SUFFIX, system_prompt=None), tokenizer,
                           chat_template=True)
    assert script.prompt_ids(tokenizer, problem) == rl_ids
    chat = f"<|im_start|>user\nWhat is 37+48?{QUICKSTART_SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    assert rl_ids == tokenizer(chat, add_special_tokens=False)["input_ids"]
    # ...and the SFT target ends with the eos the sampler stops on.
    answer = script.answer_ids(tokenizer, problem)
    assert answer[-1] == tokenizer.eos_token_id and tokenizer.decode(answer[:-1]) == problem["solution"]
    # The warm-up trains on arbor sft's encoding of the problem: that prompt, then that answer.
    example = script.sft_example(tokenizer, problem)
    (leaf,) = example.tree.leaves()
    assert example.tree.prompt_ids == rl_ids and example.tree.response_ids(leaf) == answer

    splits = {name: [json.loads(line) for line in (data / f"{name}.jsonl").read_text().splitlines()]
              for name in ("train", "test", "sft")}
    assert all(rows and set(rows[0]) == {"id", "prompt", "answer"} for rows in splits.values())
    prompts = [{r["prompt"] for r in rows} for rows in splits.values()]
    assert sum(map(len, prompts)) == len(set.union(*prompts))  # disjoint splits
    for row in splits["train"][:50]:
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", row["prompt"]).groups()
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == row["answer"]


def test_cot_task_works_columns_and_slips_consistently():
    sys.path.insert(0, str(REPO / "scripts"))
    import cot_task

    # 528173+309468: units 3+8+0=11 (write 1, carry 1), tens 7+6+1=14, ... = 837641.
    assert cot_task.solve([528173, 309468]) == (
        "3+8+0=11, 7+6+1=14, 1+4+1=6, 8+9+0=17, 2+0+1=3, 5+3+0=8, \\boxed{837641}")
    # A slip of +1 in the hundreds (6 -> 7) is carried on: the boxed answer is 100 more.
    assert cot_task.solve([528173, 309468], slip_column=2, slip=1).endswith(
        "1+4+1=7, 8+9+0=17, 2+0+1=3, 5+3+0=8, \\boxed{837741}")
    # A column of zeros slips up, never to -1.
    assert cot_task.solve([100000, 100000], slip_column=0, slip=-1).startswith("0+0+0=1, ")
    problems = cot_task.make_problems(seed=3, count=400, corrupt=0.5)
    assert problems == cot_task.make_problems(seed=3, count=400, corrupt=0.5)  # seeded
    assert len({p["prompt"] for p in problems}) == 400
    for p in problems:
        a, b = map(int, re.fullmatch(r"What is (\d{6})\+(\d{6})\?", p["prompt"]).groups())
        assert p["answer"] == str(a + b)
    boxed = [re.search(r"\\boxed\{(\d+)\}$", p["solution"])[1] for p in problems]
    wrong = sum(b != p["answer"] for b, p in zip(boxed, problems))
    assert 150 < wrong < 250  # about half the solutions slip, and a slip changes the answer


def _build_tiny(task: str, out: Path, data: Path, steps: int) -> subprocess.CompletedProcess:
    """A few SFT steps of ``--task`` on a one-layer model: the builder's files, not its model."""
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/build_tiny_model.py"), "--task", task, "--steps", str(steps), "--batch", "4",
         "--hidden", "64", "--layers", "1", "--eval-every", "1000", "--val-problems", "2",
         "--eval-problems", "2", "--eval-samples", "1", "--out", str(out), "--data", str(data)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_builder_cot_task_writes_disjoint_splits_and_long_answers(tmp_path):
    out, data = tmp_path / "model", tmp_path / "data"
    run = _build_tiny("cot", out, data, steps=3)
    assert "task cot" in run.stdout and re.search(r"^RESULT sampled_acc=", run.stdout, re.M)
    splits = {name: [json.loads(line) for line in (data / f"{name}.jsonl").read_text().splitlines()]
              for name in ("train", "test")}
    assert (len(splits["train"]), len(splits["test"])) == (1000, 200)
    assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["test"]}
    assert not (data / "sft.jsonl").exists()  # 20,000 warm-up problems: the seed regenerates them
    # The worked answers are 60-150 tokens with the built tokenizer: trees have prefixes to share.
    sys.path.insert(0, str(REPO / "scripts"))
    import cot_task

    tokenizer = AutoTokenizer.from_pretrained(out)
    script = _script()
    lengths = [len(script.answer_ids(tokenizer, p)) for p in cot_task.make_problems(0, 50, corrupt=0.0)]
    assert 60 <= min(lengths) and max(lengths) <= 150, lengths


def test_lookup_task_reads_two_entries_and_misreads_from_the_neighbour():
    sys.path.insert(0, str(REPO / "scripts"))
    import lookup_task

    digits = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 8]
    table = dict(zip(lookup_task.KEYS, digits))  # a=3, b=1, ..., z=8
    assert lookup_task.solve(table, ["c", "k"]) == "read c4, k5, 4+5=9 \\boxed{9}"
    # Misreading the second entry takes l's value for k (8): the sum changes, carried on.
    assert lookup_task.solve(table, ["c", "k"], misread=[1]) == "read c4, k8, 4+8=12 \\boxed{12}"
    assert lookup_task.solve(table, ["c", "k"], misread=[0, 1]) == "read c1, k8, 1+8=9 \\boxed{9}"
    assert lookup_task.solve(table, ["z", "a"], misread=[0]) == "read z3, a3, 3+3=6 \\boxed{6}"  # wraps to a
    problems = lookup_task.make_problems(seed=3, count=400, corrupt=0.5)
    assert problems == lookup_task.make_problems(seed=3, count=400, corrupt=0.5)  # seeded
    slips = 0
    for p in problems:
        listing, x, y = re.fullmatch(r"Table: ((?:[a-z]\d ?){26})\. What is ([a-z]) \+ ([a-z])\?", p["prompt"]).groups()
        values = {entry[0]: int(entry[1]) for entry in listing.split()}
        assert x != y and p["answer"] == str(values[x] + values[y])
        reads = re.match(r"read ([a-z])(\d), ([a-z])(\d),", p["solution"]).groups()
        assert (reads[0], reads[2]) == (x, y)
        nxt = {k: lookup_task.KEYS[(lookup_task.KEYS.index(k) + 1) % 26] for k in (x, y)}
        for key, read in ((x, reads[1]), (y, reads[3])):
            assert int(read) in (values[key], values[nxt[key]])  # the entry, or its neighbour's
            slips += int(read) != values[key]
    # Each read slips with probability 0.5 (unseen when the neighbour holds the same digit: 0.1).
    assert 0.4 * 800 < slips < 0.5 * 800, slips


def test_builder_lookup_task_has_long_shared_prompts_and_short_answers(tmp_path):
    out, data = tmp_path / "model", tmp_path / "data"
    assert "task lookup" in _build_tiny("lookup", out, data, steps=2).stdout
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(train) == 1000 and train[0]["id"].startswith("lookup-")
    sys.path.insert(0, str(REPO / "scripts"))
    import lookup_task

    tokenizer = AutoTokenizer.from_pretrained(out)
    script = _script()
    problems = lookup_task.make_problems(0, 50, corrupt=0.0)
    prompts = [len(script.prompt_ids(tokenizer, p)) for p in problems]
    answers = [len(script.answer_ids(tokenizer, p)) for p in problems]
    # The shared context is over 3x the decision (what tree packing saves per answer), within
    # configs/lookup.yaml's data.max_prompt_tokens (96) and response budget (32).
    assert min(prompts) > 3 * max(answers) and max(prompts) <= 96 and max(answers) <= 32, (prompts, answers)
    # Each value is one token right after its key's token, in the table and in the answer alike.
    table = tokenizer.tokenize(problems[0]["prompt"])
    answer = tokenizer.tokenize(problems[0]["solution"])
    assert answer[1] in table and table[table.index(answer[1]) + 1].isdigit() and answer[2].isdigit(), (table, answer)
