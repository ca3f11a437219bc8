"""scripts/prepare_data.py: hand-made rows in the layouts of MATH, MATH-500,
GSM8K and verl's DeepScaleR / DAPO-Math-17k, each in a different container (jsonl, parquet,
a save_to_disk folder), come out in arbor's columns and load with the default data keys."""

import importlib.util
import json
from pathlib import Path

import datasets

from arbor.config import DataConfig
from arbor.data import load_problems

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts" / "prepare_data.py")
prepare_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_data)

MATH_ROWS = [  # MATH (lighteval layout): the answer is the solution's last \boxed{}
    {"problem": "What is $\\frac{2}{4}$ in lowest terms?", "level": "Level 1", "type": "Prealgebra",
     "solution": "Divide by 2: $\\boxed{1}$ over... no: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."},
    {"problem": "Compute $3^2$.", "level": "Level 1", "type": "Algebra", "solution": "$3^2 = \\boxed{9}$"},
    {"problem": "A proof.", "level": "Level 5", "type": "Geometry", "solution": "No final answer here."},
]
MATH500_ROWS = [  # MATH-500: an answer column and a unique_id
    {"problem": "Find $x$ if $x+1=3$.", "solution": "So $x=\\boxed{2}$.", "answer": "2",
     "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
    {"problem": "Interval?", "solution": "$\\boxed{(0,1]}$", "answer": "(0,1]",
     "subject": "Intermediate Algebra", "level": 3, "unique_id": "test/intermediate_algebra/7.json"},
]
GSM8K_ROWS = [
    {"question": "Ann has 1,000 apples and buys 234 more. How many?", "answer": "1000+234=<<1000+234=1234>>1234\n#### 1,234"},
    {"question": "Bob has 3 pens and loses 5. How many?", "answer": "3-5=-2\n#### -2"},
    {"question": "No marker.", "answer": "just text"},
]
VERL_ROWS = [  # DAPO-Math-17k / DeepScaleR as verl preprocesses them
    {"data_source": "math_dapo", "ability": "MATH",
     "prompt": [{"role": "user", "content": "Solve 2x=8. Put the answer in \\boxed{}."}],
     "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "4"},
     "extra_info": {"index": "a1b2"}},
    {"data_source": "math_dapo", "ability": "MATH",
     "prompt": [{"role": "system", "content": "Reason first."}, {"role": "user", "content": "1+1?"}],
     "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": "c3d4"}},
]


def run(*args):
    return prepare_data.main([*map(str, args)])


def test_math_jsonl_to_jsonl(tmp_path, capsys):
    src = tmp_path / "math_train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    assert run(src, "--out", tmp_path / "out" / "train.jsonl") == 0
    out = capsys.readouterr()
    assert "wrote 2 problems to" in out.out
    assert f"skipped 1 rows with no answer to extract: {src}:3" in out.err
    problems = load_problems(tmp_path / "out" / "train.jsonl", DataConfig())
    assert [(p["id"], p["answer"]) for p in problems] == [("math_train-0", "\\frac{1}{2}"), ("math_train-1", "9")]
    assert problems[0]["prompt"] == MATH_ROWS[0]["problem"]
    assert problems[0]["solution"] == MATH_ROWS[0]["solution"] and problems[0]["type"] == "Prealgebra"


def test_math500_parquet_to_parquet_uses_answer_and_unique_id(tmp_path):
    datasets.Dataset.from_list(MATH500_ROWS).to_parquet(str(tmp_path / "test.parquet"))
    assert run(tmp_path / "test.parquet", "--out", tmp_path / "test500.parquet") == 0
    problems = load_problems(tmp_path / "test500.parquet", DataConfig())
    assert [(p["id"], p["answer"], p["subject"]) for p in problems] == [
        ("test/algebra/1.json", "2", "Algebra"), ("test/intermediate_algebra/7.json", "(0,1]", "Intermediate Algebra")]


def test_gsm8k_dataset_folder(tmp_path, capsys):
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(tmp_path / "gsm8k"))
    assert run(tmp_path / "gsm8k", "--out", tmp_path / "gsm8k.jsonl") == 0
    assert f"skipped 1 rows with no answer to extract: {tmp_path / 'gsm8k'}[2]" in capsys.readouterr().err
    problems = load_problems(tmp_path / "gsm8k.jsonl", DataConfig())
    assert [(p["id"], p["answer"]) for p in problems] == [("gsm8k-0", "1234"), ("gsm8k-1", "-2")]
    assert problems[0]["solution"].endswith("#### 1,234")  # the worked answer is kept


def test_verl_parquet_keeps_messages_and_extras(tmp_path):
    datasets.Dataset.from_list(VERL_ROWS).to_parquet(str(tmp_path / "dapo.parquet"))
    assert run(tmp_path / "dapo.parquet", "--out", tmp_path / "dapo.jsonl") == 0
    problems = load_problems(tmp_path / "dapo.jsonl", DataConfig())
    assert [(p["id"], p["answer"]) for p in problems] == [("a1b2", "4"), ("c3d4", "2")]
    assert problems[1]["prompt"] == VERL_ROWS[1]["prompt"]
    assert problems[0]["data_source"] == "math_dapo" and problems[0]["extra_info"] == {"index": "a1b2"}
    assert "reward_model" not in problems[0]  # its ground truth is the answer now


def test_errors_name_the_row(tmp_path, capsys):
    src = tmp_path / "odd.jsonl"
    src.write_text(json.dumps({"text": "?", "label": 1}) + "\n")
    assert run(src, "--out", tmp_path / "o.jsonl") == 2
    assert f"prepare_data: {src}:1: no known layout in the columns ['label', 'text']" in capsys.readouterr().err
    assert run(src, "--layout", "gsm8k", "--out", tmp_path / "o.jsonl") == 2
    assert f"{src}:1: the gsm8k layout needs the columns question, answer" in capsys.readouterr().err
    dup = tmp_path / "dup.jsonl"
    dup.write_text("".join(json.dumps(r) + "\n" for r in [MATH500_ROWS[0], MATH500_ROWS[0]]))
    assert run(dup, "--out", tmp_path / "o.jsonl") == 2
    assert f"{dup}:2: duplicate problem id 'test/algebra/1.json' (first at {dup}:1)" in capsys.readouterr().err
    assert run(tmp_path / "missing.parquet", "--out", tmp_path / "o.jsonl") == 2
    assert "missing.parquet: no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_hub_without_network_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no hub; fail at once, not after retries
    assert run("--hub", "HuggingFaceH4/MATH-500", "--split", "test", "--out", tmp_path / "o.jsonl") == 2
    assert "prepare_data: --hub HuggingFaceH4/MATH-500 (split 'test'): cannot load it" in capsys.readouterr().err
