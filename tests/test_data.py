"""Problem loading (errors name file, line and id), prompt formatting, resumable order."""

import json

import pytest

from arbor.config import DataConfig
from arbor.data import DataError, ProblemStream, format_prompt, load_problems


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_rows_keep_extra_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "prompt": "1+1?", "answer": "2", "level": 1},
        {"id": "b", "prompt": "2+2?", "answer": "4"},
    ])
    problems = load_problems(path, DataConfig())
    assert problems[0] == {"id": "a", "prompt": "1+1?", "answer": "2", "level": 1}
    assert [p["id"] for p in problems] == ["a", "b"]


def test_renamed_columns_and_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"uid": 7, "problem": "q", "solution": "\\frac12"}]))
    cfg = DataConfig(id_key="uid", prompt_key="problem", answer_key="solution")
    assert load_problems(path, cfg) == [{"uid": 7, "problem": "q", "solution": "\\frac12",
                                         "id": "7", "prompt": "q", "answer": "\\frac12"}]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"id": "a", "prompt": "q", "answer": "1"}\n{"id": "b", "prompt": "q"}\n', r"d.jsonl:2: row has no 'answer' column \(data.answer_key\)"),
        ('{"id": "a", "prompt": "q", "answer": "1"}\n{broken\n', r"d.jsonl:2: invalid JSON"),
        ('{"id": "a", "prompt": "q", "answer": "1"}\n{"id": "a", "prompt": "r", "answer": "2"}\n', r"d.jsonl:2: duplicate problem id 'a' \(first at .*d.jsonl:1\)"),
        ('{"id": "a", "prompt": 3, "answer": "1"}\n', r"d.jsonl:1: 'prompt' must be text"),
        ("\n", r"no problems"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        load_problems(path, DataConfig())


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_problems(tmp_path / "x.jsonl", DataConfig())
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown dataset format"):
        load_problems(tmp_path / "x.csv", DataConfig())


class WordTokenizer:
    """Whitespace tokenizer with a chat template, enough to check the formatting logic."""

    chat_template = "yes"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return [100 + len(messages)] + [len(w) for m in messages for w in m["content"].split()] + [99]


def test_format_prompt_chat_and_plain_and_length_limit():
    problem = {"id": "p3", "prompt": "add two numbers", "answer": "3"}
    cfg = DataConfig(prompt_suffix=" boxed", system_prompt="be brief", max_prompt_tokens=8)
    assert format_prompt(problem, cfg, WordTokenizer(), chat_template=True) == [102, 2, 5, 3, 3, 7, 5, 99]
    assert format_prompt(problem, cfg, WordTokenizer(), chat_template=False) == [3, 3, 7, 5]
    with pytest.raises(DataError, match=r"problem 'p3': prompt has 8 tokens, more than data.max_prompt_tokens=4"):
        format_prompt(problem, DataConfig(prompt_suffix=" boxed", system_prompt="be brief", max_prompt_tokens=4),
                      WordTokenizer(), chat_template=True)


def test_stream_epochs_and_resume():
    problems = [{"id": str(i)} for i in range(5)]
    stream = ProblemStream(problems, seed=3)
    first = [p["id"] for p in stream.next_batch(4)]
    state = stream.state_dict()
    rest = [p["id"] for p in stream.next_batch(6)]
    # Each epoch is a permutation of all problems.
    assert sorted(first + rest[:1]) == [str(i) for i in range(5)]
    assert sorted(rest[1:]) == [str(i) for i in range(5)]
    resumed = ProblemStream(problems, seed=3)
    resumed.load_state_dict(state)
    assert [p["id"] for p in resumed.next_batch(6)] == rest
    assert [p["id"] for p in ProblemStream(problems, seed=0, shuffle=False).next_batch(3)] == ["0", "1", "2"]


def test_format_prompt_with_a_real_tokenizer(tmp_path):
    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_dir(tmp_path / "tiny"))
    problem = {"id": "p", "prompt": "What is 2+3?", "answer": "5"}
    ids = format_prompt(problem, DataConfig(prompt_suffix=" Box it."), tokenizer, chat_template=True)
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2+3? Box it.<|im_end|>\n<|im_start|>assistant\n"
    plain = format_prompt(problem, DataConfig(), tokenizer, chat_template=False)
    assert tokenizer.decode(plain) == "What is 2+3?"
