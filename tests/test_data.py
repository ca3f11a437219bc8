"""Problem loading (errors name file, line and id), prompt formatting, resumable order.
Columnar formats and dataset folders: test_dataset_files.py."""

import json
from pathlib import Path

import pytest

from arbor.config import DataConfig
from arbor.data import (
    DataError,
    ProblemStream,
    format_prompt,
    load_problems,
    prompt_messages,
    stop_token_ids,
)


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


def test_dotted_keys_reach_into_nested_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"a.b": "first", "meta": {"uid": 7}, "q": {"text": "1+1?"}, "reward_model": {"ground_truth": "2"}},
        {"a.b": "dotted name", "a": {"b": "nested"}, "meta": {"uid": 8}, "q": {"text": "2+2?"}, "reward_model": {"ground_truth": "4"}},
    ])
    cfg = DataConfig(id_key="meta.uid", prompt_key="q.text", answer_key="reward_model.ground_truth")
    problems = load_problems(path, cfg)
    assert [(p["id"], p["prompt"], p["answer"]) for p in problems] == [("7", "1+1?", "2"), ("8", "2+2?", "4")]
    assert problems[0]["reward_model"] == {"ground_truth": "2"}  # the row's own columns stay
    # A column whose own name holds the dots wins over the nested path.
    assert load_problems(path, DataConfig(id_key="meta.uid", prompt_key="q.text", answer_key="a.b"))[1]["answer"] == "dotted name"
    with pytest.raises(DataError, match=r"d.jsonl:1 \(problem '7'\): row has no 'reward_model.answer' column"):
        load_problems(path, DataConfig(id_key="meta.uid", prompt_key="q.text", answer_key="reward_model.answer"))


def test_message_prompts_keep_their_messages(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": messages, "answer": "2"}])
    assert load_problems(path, DataConfig())[0]["prompt"] == messages


def test_prompt_messages_suffix_and_system_prompt():
    assert prompt_messages("2+2?", " Box it.") == [{"role": "user", "content": "2+2? Box it."}]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes?"},
             {"role": "user", "content": "2+2?"}]
    out = prompt_messages(turns, " Box it.", system_prompt="Be brief.")
    # The suffix ends the last user message; the system prompt goes first.
    assert out == [{"role": "system", "content": "Be brief."}, turns[0], turns[1],
                   {"role": "user", "content": "2+2? Box it."}]
    assert turns[2]["content"] == "2+2?"  # the problem's own messages are not changed
    # A dataset's own system message wins over data.system_prompt.
    own = [{"role": "system", "content": "Reason in Lean."}, {"role": "user", "content": "2+2?"}]
    assert prompt_messages(own, "", system_prompt="Be brief.") == own


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"id": "a", "prompt": "q", "answer": "1"}\n{"id": "b", "prompt": "q"}\n', r"d.jsonl:2 \(problem 'b'\): row has no 'answer' column \(data.answer_key\)"),
        ('{"id": "a", "prompt": "q", "answer": "1"}\n{broken\n', r"d.jsonl:2: invalid JSON"),
        ('{"id": "a", "prompt": "q", "answer": "1"}\n{"id": "a", "prompt": "r", "answer": "2"}\n', r"d.jsonl:2: duplicate problem id 'a' \(first at .*d.jsonl:1\)"),
        ('{"id": "a", "prompt": 3, "answer": "1"}\n', r"d.jsonl:1 \(problem 'a'\): 'prompt' must be text or a list of chat messages, got int"),
        ('{"id": "a", "prompt": [], "answer": "1"}\n', r"d.jsonl:1 \(problem 'a'\): 'prompt' is an empty list of messages"),
        ('{"id": "a", "prompt": [{"role": "user"}], "answer": "1"}\n', r"d.jsonl:1 \(problem 'a'\): 'prompt' message 0 must be an object with text 'role' and 'content'"),
        ('{"prompt": [{"role": "system", "content": "s"}], "answer": "1"}\n', r"d.jsonl:1 \(problem '.*d.jsonl:1'\): 'prompt' has no user message"),
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


def test_format_prompt_of_messages_with_a_real_tokenizer(tmp_path):
    """A list-of-messages prompt renders exactly as the same text prompt does, suffix and
    system prompt included; without a chat template it is an error naming the problem."""
    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_dir(tmp_path / "tiny"))
    cfg = DataConfig(prompt_suffix=" Box it.", system_prompt="Be brief.")
    text = {"id": "t", "prompt": "What is 2+3?", "answer": "5"}
    chat = {"id": "m", "prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}
    ids = format_prompt(chat, cfg, tokenizer, chat_template=True)
    assert ids == format_prompt(text, cfg, tokenizer, chat_template=True)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                     "What is 2+3? Box it.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(DataError, match=r"problem 'm': the prompt is a list of chat messages, which needs a chat template"):
        format_prompt(chat, cfg, tokenizer, chat_template=False)


def test_agents_start_from_message_prompts(tmp_path):
    """The shipped agents take text or chat-message prompts; a single-turn episode from a
    dataset's messages has the ids arbor train gives the same problem without an agent."""
    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    from arbor.rollout.agents import episode_inputs, load_agent

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_dir(tmp_path / "tiny"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    problem = {"id": "m", "prompt": messages, "answer": "5"}
    repo = [str(Path(__file__).resolve().parents[1])]
    single = load_agent("agents/single_turn.py:SingleTurn", search_dirs=repo)
    assert single.start(problem) == messages
    cfg = DataConfig(system_prompt="ignored: the dataset has its own")
    (with_agent,), _ = episode_inputs([problem], single, tokenizer, cfg, chat_template=True)
    assert with_agent == format_prompt(problem, cfg, tokenizer, chat_template=True)
    tool = load_agent("agents/python_tool.py:PythonTool", search_dirs=repo, kwargs={"workers": 1})
    start = tool.start(problem)
    assert start[0] == messages[0] and start[1]["content"].startswith("What is 2+3?\nYou may run Python")
    assert messages[1]["content"] == "What is 2+3?"  # the problem is left as it was


def test_stop_token_ids_join_tokenizer_config_and_generation_config(tmp_path):
    """A Qwen2.5-Instruct-like checkpoint: the tokenizer's EOS is <|endoftext|> (0), the
    turn ends on <|im_end|> (2) that only generation_config.json lists: both stop."""
    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    path = build_tiny_model_dir(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert stop_token_ids(tokenizer) == [0]  # config.json and the tokenizer agree on 0
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 0}))
    assert stop_token_ids(tokenizer) == [0, 2]
    assert stop_token_ids(AutoTokenizer.from_pretrained(path), str(path)) == [0, 2]
    tokenizer_only = tmp_path / "tok"
    tokenizer.save_pretrained(tokenizer_only)
    assert stop_token_ids(AutoTokenizer.from_pretrained(tokenizer_only)) == [0]


def test_a_template_default_system_prompt_is_kept_or_replaced(tmp_path):
    """SmolLM2's template adds its own system prompt when the messages have none: with
    data.system_prompt unset the prompt carries the template's default, with it set the
    given one replaces it (never both)."""
    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_dir(tmp_path / "tiny"))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    problem = {"id": "p", "prompt": "What is 2+3?", "answer": "5"}
    default = tokenizer.decode(format_prompt(problem, DataConfig(), tokenizer, chat_template=True))
    assert default == ("<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n"
                       "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    own = tokenizer.decode(format_prompt(problem, DataConfig(system_prompt="Be brief."), tokenizer, chat_template=True))
    assert own == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                   "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_a_failed_eos_lookup_is_loud(tmp_path, caplog):
    """A generation_config.json that is there but broken is warned about, naming the model
    and the file; a model with no end-of-turn id anywhere is an error naming it (sampling
    would otherwise run every path to max length)."""
    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    path = build_tiny_model_dir(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    (path / "generation_config.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="arbor.data"):
        assert stop_token_ids(tokenizer) == [0]  # the tokenizer's and config.json's EOS still
    assert f"model {path}: could not read eos_token_id from generation_config.json" in caplog.text

    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config.pop("eos_token_id", None)
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.eos_token = None
    with pytest.raises(DataError, match=rf"model {path}: no end-of-turn token"):
        stop_token_ids(tokenizer)
