"""Datasets as users keep them: parquet, arrow, save_to_disk folders, folders of
shards, verl's nested rows; written here by the real ``datasets`` library from hand-made rows."""

import json

import datasets
import pytest

from arbor.config import DataConfig
from arbor.data import DataError, load_problems

# verl's layout (examples/data_preprocess/gsm8k.py, math_dataset.py): no id column, the
# prompt is chat messages, the answer is nested in reward_model.
VERL_ROWS = [
    {
        "data_source": "hand/made", "ability": "math",
        "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": "train", "index": i},
    }
    for i, (a, b) in enumerate([(1, 2), (30, 4), (5, 60)])
]
VERL_CFG = DataConfig(id_key="extra_info.index", answer_key="reward_model.ground_truth")
PLAIN_ROWS = [{"id": f"p{i}", "prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(4)]


def to_parquet(rows, path):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_verl_parquet_through_load_problems(tmp_path):
    problems = load_problems(to_parquet(VERL_ROWS, tmp_path / "train.parquet"), VERL_CFG)
    assert [p["id"] for p in problems] == ["0", "1", "2"]
    assert [p["answer"] for p in problems] == ["3", "34", "65"]
    assert problems[1]["prompt"] == [{"role": "user", "content": "What is 30+4?"}]
    # Every column stays for the reward functions, nested ones as dicts.
    assert problems[2]["reward_model"] == {"style": "rule", "ground_truth": "65"}
    assert problems[2]["extra_info"] == {"split": "train", "index": 2}
    assert problems[0]["data_source"] == "hand/made"


def test_verl_rows_without_an_id_key_are_named_by_their_row(tmp_path):
    path = to_parquet(VERL_ROWS, tmp_path / "train.parquet")
    problems = load_problems(path, DataConfig(answer_key="reward_model.ground_truth"))
    assert [p["id"] for p in problems] == [f"{path}[{i}]" for i in range(3)]


def test_parquet_errors_name_file_row_and_problem(tmp_path):
    rows = [dict(r) for r in VERL_ROWS]
    rows[1] = {**rows[1], "reward_model": {"style": "rule", "ground_truth": None}}
    path = to_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet\[1\] \(problem '1'\): row has no 'reward_model.ground_truth' column"):
        load_problems(path, VERL_CFG)
    rows = [dict(r) for r in VERL_ROWS]
    rows[2] = {**rows[2], "prompt": [{"role": "assistant", "content": "65"}]}
    with pytest.raises(DataError, match=r"bad2.parquet\[2\] \(problem '2'\): 'prompt' has no user message"):
        load_problems(to_parquet(rows, tmp_path / "bad2.parquet"), VERL_CFG)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"junk.parquet: cannot read it as parquet"):
        load_problems(tmp_path / "junk.parquet", DataConfig())


def test_save_to_disk_folder_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(PLAIN_ROWS).save_to_disk(str(tmp_path / "saved"))
    assert [p["id"] for p in load_problems(tmp_path / "saved", DataConfig())] == ["p0", "p1", "p2", "p3"]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(PLAIN_ROWS[:3]),
                                   "test": datasets.Dataset.from_list(PLAIN_ROWS[3:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"a saved DatasetDict with the splits test, train; give one split's folder"):
        load_problems(tmp_path / "dict", DataConfig())
    assert [p["id"] for p in load_problems(tmp_path / "dict" / "test", DataConfig())] == ["p3"]


def test_folders_of_shards(tmp_path):
    (tmp_path / "pq").mkdir()
    to_parquet(PLAIN_ROWS[:2], tmp_path / "pq" / "part-00000.parquet")
    to_parquet(PLAIN_ROWS[2:], tmp_path / "pq" / "part-00001.parquet")
    assert [p["id"] for p in load_problems(tmp_path / "pq", DataConfig())] == ["p0", "p1", "p2", "p3"]

    (tmp_path / "jl").mkdir()
    (tmp_path / "jl" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PLAIN_ROWS[:3]))
    (tmp_path / "jl" / "b.jsonl").write_text(json.dumps({"id": "p0", "prompt": "again", "answer": "0"}) + "\n")
    with pytest.raises(DataError, match=r"b.jsonl:1: duplicate problem id 'p0' \(first at .*a.jsonl:1\)"):
        load_problems(tmp_path / "jl", DataConfig())

    (tmp_path / "jl" / "c.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"shards of several formats \(.jsonl, .parquet\)"):
        load_problems(tmp_path / "jl", DataConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory with no dataset in it"):
        load_problems(tmp_path / "empty", DataConfig())


def test_arrow_file(tmp_path):
    datasets.Dataset.from_list(PLAIN_ROWS).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    assert [p["answer"] for p in load_problems(arrow, DataConfig())] == ["0", "2", "4", "6"]
