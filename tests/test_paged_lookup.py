"""The paged lookup: envs/paged_lookup.py's episodes, state and judgement, and its problems
(scripts/paged_lookup_task.py, data/paged-lookup)."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import paged_lookup_task as task  # noqa: E402

from arbor.rollout.environments import load_env  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402
from envs.paged_lookup import KEYS, PagedLookup, page_text  # noqa: E402

# A book of two pages: page 1 holds 0 1 2 ... 9 0 1 ... in key order, page 2 all 7s.
BOOK = ["".join(str(i % 10) for i in range(52)), "7" * 52]
PROBLEM = {"id": "p", "prompt": "Open page 1, then answer the question about it.", "answer": "9", "page": 1,
           "keys": ["K", "d"], "pages": BOOK}


def play(env: PagedLookup, turns: list[str], problem: dict = PROBLEM) -> list[dict]:
    """An episode: reset, then each model turn answered by env.step; returns the history."""
    history = env.reset(problem, seed=0)
    for turn in turns:
        history.append({"role": "assistant", "content": turn})
        step = env.step(history)
        history += step.messages
        if step.done:
            break
    return history


def test_an_episode_opens_the_page_reads_it_and_is_judged_by_the_environment():
    # As a config names it: arbor checks it against the protocol once (forks by copy, gives a reward).
    source = load_env("envs/paged_lookup.py:PagedLookup", search_dirs=[str(REPO)], kwargs={"max_opens": 2})
    assert source.gives_reward and source.make().fork == "copy"
    env = source.make()
    history = play(env, ["open page 1", "read K6, d3, 6+3=9 \\boxed{9}"])  # K is key 36, d key 3
    assert history[0]["content"] == ('The book has 2 pages; to read one, write "open page" and its number. '
                                     "Open page 1, then answer the question about it.")
    # The page, then the question: the user asks once the model has the page.
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "user", "assistant"]
    assert history[3]["content"] == "What is K + d? Put the answer in \\boxed{}."
    page = history[2]["content"]
    assert page == page_text(1, BOOK) and page.startswith("Page 1 of 2\n- a0\n- b1\n")
    assert len(page.splitlines()) == 53 and page.endswith("- Z1")  # a header and 52 entries
    assert env.opened == [1] and env.answer == "9" and env.reward() == 1.0
    env.close()


@pytest.mark.parametrize("turns, why", [
    (["open page 1", "read K6, d4, 6+4=10 \\boxed{10}"], "a slip: d's neighbour e holds 4"),
    (["\\boxed{9}"], "the right sum, but the book was never opened"),
    (["open page 2", "\\boxed{9}"], "the right sum, but the page of the question was never opened"),
    (["open page 1", "read K6, d3, 6+3=9"], "no boxed answer"),
    (["open page 1", "open page 1", "open page 1"], "a third call past max_opens 2: no answer"),
])
def test_wrong_unread_or_unanswered_episodes_score_zero(turns, why):
    env = PagedLookup()
    play(env, turns)
    assert env.reward() == 0.0, why


def test_a_page_that_does_not_exist_is_a_tool_error_and_counts_as_a_call():
    env = PagedLookup(max_opens=2)
    history = play(env, ["open page 9", "open page 1", "\\boxed{9}"])
    assert history[2] == {"role": "tool", "content": "There is no page 9: the book has pages 1 to 2.", "error": True}
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant", "tool", "user", "assistant"]
    assert env.calls == 2 and env.opened == [1] and env.reward() == 1.0
    assert play(PagedLookup(max_opens=1), ["open page 9", "open page 1"])[-1]["role"] == "assistant"  # ended


def test_copies_share_nothing_that_changes():
    env = PagedLookup()
    history = play(env, ["open page 2"])
    twin = env.copy()
    # The original goes on to the right page and answers; the copy's state is as it was.
    history.append({"role": "assistant", "content": "open page 1"})
    env.step(history)
    env.step([*history, {"role": "assistant", "content": "\\boxed{9}"}])
    assert (env.opened, env.answer, env.reward()) == ([2, 1], "9", 1.0)
    assert (twin.opened, twin.calls, twin.answer) == ([2], 1, None)
    twin.step([*history[:-1], {"role": "assistant", "content": "\\boxed{9}"}])
    assert twin.reward() == 0.0 and env.reward() == 1.0  # page 1 was opened by the original only


def test_replaying_the_actions_reproduces_every_observation():
    turns = ["open page 2", "open page 1", "read K6, d3, 6+3=9 \\boxed{9}"]
    first, second = PagedLookup(), PagedLookup()
    assert play(first, turns) == play(second, turns) and first.reward() == second.reward() == 1.0


def test_problems_that_are_not_books_are_refused():
    for bad in ({"pages": ["12"]}, {"page": 3}, {"keys": ["K", "é"]}):
        with pytest.raises(ValueError, match="problem p"):
            PagedLookup().reset({**PROBLEM, **bad}, seed=0)


def test_the_task_misreads_from_the_next_line_and_its_answers_are_the_environments():
    page = BOOK[0]
    assert task.solve(page, ["K", "d"]) == "read K6, d3, 6+3=9 \\boxed{9}"
    assert task.solve(page, ["K", "d"], misread=[1]) == "read K6, d4, 6+4=10 \\boxed{10}"
    assert task.solve(page, ["Z", "c"], misread=[0]) == "read Z0, c2, 0+2=2 \\boxed{2}"  # Z's neighbour is a
    problems = task.make_problems(seed=3, count=2000, corrupt=0.5)
    assert problems == task.make_problems(seed=3, count=2000, corrupt=0.5)  # seeded
    slips = 0
    for p in problems:
        env = PagedLookup()
        play(env, [task.open_call(p["page"]), p["solution"]], p)
        values = p["pages"][p["page"] - 1]
        truth = [int(values[KEYS.index(k)]) for k in p["keys"]]
        assert p["keys"][0] != p["keys"][1] and p["answer"] == str(sum(truth))
        assert env.reward() == float(env.answer == p["answer"])
        slips += sum(p["solution"].count(f"{k}{v},") == 0 for k, v in zip(p["keys"], truth))
    # Each read slips with probability 0.5, unseen when the neighbour holds the same digit (0.1).
    assert 0.42 * 4000 < slips < 0.48 * 4000, slips


def test_the_shipped_data_is_the_generators_and_plays_in_the_environment():
    """data/paged-lookup is what scripts/build_paged_model.py wrote: its splits, books and answers."""
    rows = {name: [json.loads(line) for line in (REPO / "data/paged-lookup" / f"{name}.jsonl").open()]
            for name in ("train", "test")}
    assert len(rows["test"]) == 200 and len(rows["train"]) == 1000
    problems = task.make_problems(0, 1300, corrupt=0.55)  # the builder's seed, its first splits
    fields = ("id", "prompt", "answer", "page", "keys", "pages")
    assert rows["test"] == [{k: p[k] for k in fields} for p in problems[:200]]
    assert rows["train"] == [{k: p[k] for k in fields} for p in problems[300:1300]]
    for row in rows["train"][:100]:
        env = PagedLookup()
        page = play(env, [task.open_call(row["page"])], row)[2]["content"]  # the tool message
        reads = [f"{k}{page.split(f'- {k}')[1][0]}" for k in row["keys"]]  # read off the page
        env.step([{"role": "assistant", "content": f"read {', '.join(reads)} \\boxed{{{row['answer']}}}"}])
        assert env.reward() == 1.0


def test_the_config_forks_after_the_page_and_the_environment_gives_the_reward(tmp_path):
    """One step of configs/paged_lookup.yaml on 4 problems: each tree is one path to the end
    of the page and the question, then 8 answers; the reward is the environment's."""
    from arbor.config_load import load_config
    from arbor.run.trainer import train

    out = tmp_path / "out"
    cfg = load_config(REPO / "configs/paged_lookup.yaml", [
        f"run.output_dir={out}", "run.steps=1", "run.eval_every=0", "data.prompts_per_step=4",
        "learner.backend=torch", "learner.zero_stage=0", "algorithm.dynamic_sampling=false", "run.save_trees_every=1",
        "algorithm.max_staleness=0",
    ])  # the trees of the step are saved: their shape is checked below
    (metrics,) = train(cfg)
    assert metrics["tree/leaves"] == 8 and metrics["env/steps_per_episode"] == 2  # the call, the answer
    assert metrics["env/reward_mean"] == metrics["reward/mean"] and metrics["env/live"] == 0
    assert metrics["env/errors"] == 0 and metrics["env/forks/copy"] > 0
    # ~270 of an episode's ~310 tokens come before the fork: the tree holds them once.
    assert metrics["tree/sharing_ratio"] > 4, metrics["tree/sharing_ratio"]
    assert metrics["response/max_length"] == 0  # every episode fits rollout's response budget
    (saved,) = (out / "trees").glob("step-*.jsonl")
    for line in saved.read_text().splitlines():
        tree = RolloutTree.from_json(line)
        (call,) = tree.root.children  # root_fork 1: one path makes the call ...
        (page,) = call.children  # ... and gets the page and the question (untrained) ...
        assert call.loss_mask is None and not any(page.loss_mask)  # sampled; the environment's
        assert len(page.children) == 8 and all(child.is_leaf for child in page.children)  # ... then 8 answers
