"""scripts/build_paged_model.py: warm-up episodes are exactly what arbor's sampling produces,
episodes on one page train as one tree, and the builder writes a model and problem files."""

import json
import re
import subprocess
import sys

import pytest
from script_loader import REPO, load_script
from transformers import AutoModelForCausalLM, AutoTokenizer

from arbor.data import chat_template_ids
from arbor.rollout.agents import continuation_ids


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The builder's module, a tokenizer trained as it trains one, and warm-up problems."""
    builder = load_script("build_paged_model")
    task = sys.modules["paged_lookup_task"]
    problems = task.make_problems(seed=1, count=64, corrupt=0.5, questions=4)
    corpus = [builder.CHAT_TEMPLATE] + [
        "\n".join(f"{m['role']}\n{m['content']}" for m in builder.episode(p, p["solution"])) for p in problems]
    tokenizer = builder.build_tokenizer(corpus, 384, tmp_path_factory.mktemp("tokenizer"))
    builder.check_tokenizer(tokenizer)
    return builder, tokenizer, problems


def test_a_warm_up_episode_is_the_ids_sampling_makes(built):
    """The model's turns as sampled ids + EOS, the environment's messages appended as the chat
    template's continuation (arbor.rollout.agents.continuation_ids): what the learner sees in RL."""
    builder, tokenizer, problems = built
    problem = problems[0]
    messages = builder.episode(problem, problem["solution"])
    (leaf,) = (example := builder.encode(tokenizer, problem, messages)).tree.leaves()
    eos = tokenizer.eos_token_id

    def said(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]

    sampled = (said(messages[1]["content"]) + continuation_ids(tokenizer, messages[2:4])
               + said(messages[4]["content"]))
    assert example.tree.prompt_ids == chat_template_ids(tokenizer, messages[:1], generation_prompt=True)
    ids = example.tree.response_ids(leaf)
    assert ids[: len(sampled)] == sampled and tokenizer.decode(ids[len(sampled):]) == "\n"  # the template's newline
    trained = tokenizer.decode([t for t, m in zip(ids, leaf.loss_mask) if m])
    assert trained == f"{messages[1]['content']}<|im_end|>{messages[4]['content']}<|im_end|>"


def test_episodes_on_one_page_are_one_tree_with_the_page_once(built):
    builder, tokenizer, problems = built
    group = problems[:4]  # one book and page, four questions
    assert len({p["page"] for p in group}) == 1 and len({tuple(p["keys"]) for p in group}) == 4
    episodes = [builder.encode(tokenizer, p, builder.episode(p, p["solution"])) for p in group]
    tree = builder.page_tree(episodes).tree
    (page,) = tree.root.children
    assert "Page" in tokenizer.decode(page.token_ids) and len(tree.leaves()) == 4
    for episode, leaf in zip(episodes, tree.leaves()):
        (alone,) = episode.tree.leaves()
        path = tree.path(leaf)
        assert tree.response_ids(leaf) == episode.tree.response_ids(alone)
        assert [m for node in path for m in node.loss_mask] == alone.loss_mask
    separate = sum(len(e.tree.response_ids(e.tree.leaves()[0])) for e in episodes)
    together = sum(len(node.token_ids) for node in tree.nodes())
    assert together < separate / 2.5, (together, separate)  # the ~220-token page once, not 4 times


def test_the_builder_writes_a_model_and_problem_files(tmp_path):
    out, data = tmp_path / "model", tmp_path / "data"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/build_paged_model.py"), "--steps", "3", "--batch", "2",
         "--sft-problems", "32", "--questions", "4", "--hidden", "64", "--layers", "2", "--eval-every", "2",
         "--val-problems", "3", "--eval-problems", "3", "--out", str(out), "--data", str(data)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "32 warm-up episodes" in run.stdout and "in 8 trees" in run.stdout
    assert re.search(r"^RESULT greedy_exact=[\d.]+ read=[\d.]+ read_or_slip=[\d.]+ params=\d+ build_s=\d+$",
                     run.stdout, re.M), run.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.max_position_embeddings == 512 and model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 1000 and set(rows[0]) == {"id", "prompt", "answer", "page", "keys", "pages"}
