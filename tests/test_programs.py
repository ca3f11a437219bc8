"""Agent programs through the OpenAI-compatible endpoint, with the real ``openai`` client.

A scripted engine (answers chosen per call, as tests/test_sampler.py's) pins the tool-call
round trip and token exactness; the tiny model behind the embedded engine runs the example
program of agents/ with forks by replay, and an unseeded program is caught diverging.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.plugins import load_object
from arbor.rollout.program_render import ChatRender, message_key, parse_reply
from arbor.rollout.programs import (
    ProgramSource,
    load_program,
    program_metrics,
    sample_program_trees,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-arith"
PROBLEM = {"id": "p0", "prompt": "What is 12+23? Put the answer in \\boxed{}.", "answer": "35"}
TOOL_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12+23"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


class ScriptedEngine:
    """Answers the k-th model turn of a conversation (its k-th assistant header) with
    ``texts[k]`` + EOS, cut to ``max_new_tokens`` ("length"), ``n`` times: the i-th output's
    tokens at log-prob -0.25 · i (one output: -0.25); keeps every request."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self.requests.append(request)
        # A batch takes a while, as on an engine: every run of a fork point is waiting for it.
        await asyncio.sleep(0.5 if request.sampling.n > 1 else 0)
        eos = self.tokenizer.eos_token_id
        turn = self.tokenizer.decode(request.input_ids).count("<|im_start|>assistant") - 1
        ids = [*self.tokenizer.encode(self.texts[min(turn, len(self.texts) - 1)], add_special_tokens=False), eos]
        cut = ids[: request.sampling.max_new_tokens]
        return [GenerateOutput(cut, [-0.25 * (k + 1)] * len(cut), "stop" if cut == ids else "length",
                               len(request.input_ids), 0, "v1") for k in range(request.sampling.n)]


def run(engine, program, tokenizer, **cfg) -> tuple:
    defaults = {"width": 1, "branch": 1, "segment_tokens": 128, "max_depth": 2}
    rollout = RolloutConfig(**(defaults | cfg))
    source = program if isinstance(program, ProgramSource) else ProgramSource("rollout.program", function=program)
    trees, stats = asyncio.run(sample_program_trees(engine, [PROBLEM], rollout, program=source, tokenizer=tokenizer,
                                                    stop_ids=[tokenizer.eos_token_id], seed=3))
    return trees[0], stats[0]


def test_a_tool_call_round_trip_is_token_exact(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, [TOOL_CALL, "35 \\boxed{35}", "done"])
    seen: dict = {}

    async def program(problem, ctx):
        client = ctx.openai_client()
        seen["models"] = [m.id for m in (await client.models.list()).data]
        messages = [{"role": "user", "content": problem["prompt"]}]
        tools = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]
        first = (await client.chat.completions.create(model=ctx.model, messages=messages, tools=tools,
                                                      temperature=0.3)).choices[0]
        seen["first"] = first
        call = first.message.tool_calls[0]
        # Sent back as a framework would: the arguments re-serialised with other spacing.
        back = first.message.model_dump(exclude_none=True)
        back["tool_calls"][0]["function"]["arguments"] = json.dumps(json.loads(call.function.arguments), indent=2)
        messages += [back, {"role": "tool", "tool_call_id": call.id, "content": "35"}]
        second = (await client.chat.completions.create(model=ctx.model, messages=messages, tools=tools)).choices[0]
        messages += [second.message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        third = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=2)
        seen["third"] = third.choices[0]
        with pytest.raises(openai.BadRequestError, match="n=2 is not served"):
            await client.chat.completions.create(model=ctx.model, messages=messages, n=2)
        return 0.5

    tree, stats = run(engine, program, tokenizer)
    assert seen["models"] == ["arbor-policy"]
    first = seen["first"]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.tool_calls[0].function.name == "calculate"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"expression": "12+23"}
    assert seen["third"].finish_reason == "length"  # max_tokens=2 cut the answer
    assert (stats.program_calls, stats.program_retokenized, stats.program_offpath_calls) == (3, 0, 0)  # n=2 is refused first
    assert stats.program_ignored_params == 1  # the temperature
    [leaf] = tree.leaves()
    assert leaf.env_reward == 0.5
    # One path: each sampled answer exactly the engine's ids (mask 1, its log-probs), each
    # request's prompt the path so far, everything between context (mask 0).
    path = tree.path(leaf)
    sampled = [n for n in path if n.loss_mask is None]
    assert [n.token_ids for n in sampled] == [_ids(tokenizer, TOOL_CALL), _ids(tokenizer, "35 \\boxed{35}"),
                                              _ids(tokenizer, "done")[:2]]
    assert all(lp == -0.25 for n in sampled for lp in n.logprobs)
    assert all(set(n.loss_mask or [1]) == {0} for n in path if n not in sampled)
    requests = engine.requests[:3]
    for request, node in zip(requests, sampled):
        assert request.input_ids == tree.prompt_ids + tree.response_ids(node.parent)
    assert requests[2].sampling.max_new_tokens == 2


def _ids(tokenizer, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def test_a_changed_assistant_message_is_retokenized_and_never_trained(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, ["12+23=35 \\boxed{35}", "ok"])

    async def program(problem, ctx):
        client = ctx.openai_client()
        messages = [{"role": "user", "content": problem["prompt"]}]
        reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        edited = {"role": "assistant", "content": reply.choices[0].message.content + " (edited)"}
        await client.chat.completions.create(model=ctx.model, messages=[*messages, edited,
                                                                        {"role": "user", "content": "Again."}])

    tree, stats = run(engine, program, tokenizer)
    assert (stats.program_retokenized, stats.program_offpath_calls) == (1, 1)
    [leaf] = tree.leaves()  # the first call's answer: the second call is not on its path
    assert tokenizer.decode(leaf.token_ids, skip_special_tokens=True) == "12+23=35 \\boxed{35}"


def test_render_splices_sampled_ids_and_keys_ignore_json_spacing(tokenizer) -> None:
    render = ChatRender(tokenizer, [tokenizer.eos_token_id])
    sampled_ids = [*tokenizer.encode("x  y", add_special_tokens=False)]  # cut: no end marker
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x y"},
               {"role": "user", "content": "more"}]
    ids, changed = render.prompt_ids(history, None, {message_key("x y", None): sampled_ids})
    head = tokenizer.apply_chat_template(history[:1], add_generation_prompt=True, tokenize=False)
    assert changed == []
    assert tokenizer.decode(ids) == head + "x  y<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert message_key(None, [{"function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}]) == \
        message_key("", [{"function": {"name": "f", "arguments": '{"b":2,"a":1}'}}])
    content, calls = parse_reply("Let me add. " + TOOL_CALL, [7, 8], "hermes")
    assert content == "Let me add." and calls[0]["function"]["name"] == "calculate"
    assert parse_reply("<tool_call>not json</tool_call>", [1], "hermes") == ("<tool_call>not json</tool_call>", [])


def test_the_example_program_forks_by_replay_on_the_tiny_model(tokenizer) -> None:
    from arbor.engines.embedded.engine import LocalEngine

    engine = LocalEngine(MODEL)
    program = load_object("agents/openai_tool.py:program", "rollout.program", [str(ROOT)])
    tree, stats = run(engine, program, tokenizer, width=4, branch=2, segment_tokens=32, max_depth=4)
    assert len(tree.leaves()) == 4 and stats.program_runs == 4
    assert stats.program_replayed_calls > 0 and stats.program_diverged == 0
    assert stats.program_retokenized == 0 and stats.program_offpath_calls == 0
    metrics = program_metrics([stats])
    assert metrics["program/calls"] == 12 and metrics["program/seconds"] > 0
    # Every leaf's path holds its three answers, trained, between context turns.
    for leaf in tree.leaves():
        assert sum(n.loss_mask is None for n in tree.path(leaf)) == 3


def test_forks_inside_an_answer_go_on_from_the_ids_sampled_so_far(tokenizer) -> None:
    from arbor.engines.embedded.engine import LocalEngine

    program = load_object("agents/openai_tool.py:program", "rollout.program", [str(ROOT)])
    tree, stats = run(LocalEngine(MODEL), program, tokenizer, width=8, branch=2, segment_tokens=4, max_depth=32)
    assert len(tree.leaves()) == 8 and stats.program_diverged == 0 and stats.program_errors == 0
    # A fork's reply holds the parent's ids before the fork: sent back, they extend its path.
    assert stats.program_retokenized == 0 and stats.program_offpath_calls == 0
    inside = [n for n in tree.nodes() if n.loss_mask is None and len(n.children) > 1
              and all(c.loss_mask is None for c in n.children)]
    assert inside, "some run forked inside an answer"


def test_a_program_reading_an_unseeded_rng_is_caught_diverging(tokenizer) -> None:
    from arbor.engines.embedded.engine import LocalEngine

    async def program(problem, ctx):
        client = ctx.openai_client()
        messages = [{"role": "user", "content": problem["prompt"]}]
        for _ in range(2):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"Check {random.SystemRandom().random():.6f}"}]
        await client.chat.completions.create(model=ctx.model, messages=messages)

    tree, stats = run(LocalEngine(MODEL), program, tokenizer, width=4, branch=2, segment_tokens=32, max_depth=4)
    # Forks at the start of call 2 replay call 1 and send another call 2: diverged, dropped.
    assert stats.program_diverged >= 1
    assert len(tree.leaves()) == 4 - stats.program_diverged


def test_plain_def_programs_commands_crashes_and_timeouts(tokenizer, tmp_path) -> None:
    engine = ScriptedEngine(tokenizer, ["35"])

    def plain(problem, ctx):
        client = ctx.openai_client()
        assert isinstance(client, openai.OpenAI)
        client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": problem["prompt"]}])
        return 1.0

    tree, stats = run(engine, plain, tokenizer, width=2, branch=2)
    assert [leaf.env_reward for leaf in tree.leaves()] == [1.0, 1.0] and stats.program_errors == 0

    script = tmp_path / "prog.py"
    script.write_text(
        "import json, os, sys\nimport openai\nproblem = json.load(sys.stdin)\n"
        "client = openai.OpenAI()\n"
        "r = client.chat.completions.create(model=os.environ['ARBOR_MODEL'], messages=[{'role': 'user', "
        "'content': problem['prompt']}])\n"
        "print('chatter')\nprint(json.dumps({'reward': 0.25 if os.environ['ARBOR_SEED'] else 0}))\n")
    command = load_program(RolloutConfig(program_command=["python", str(script)]))
    assert command is not None and command.command[0] == sys.executable
    tree, stats = run(engine, command, tokenizer, width=2, branch=2)
    assert [leaf.env_reward for leaf in tree.leaves()] == [0.25, 0.25]

    async def crashes(problem, ctx):
        await ctx.openai_client().chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "q"}])
        raise RuntimeError("boom")

    tree, stats = run(engine, crashes, tokenizer, width=2, branch=2)
    assert (stats.program_errors, len(tree.leaves()), stats.env_dropped) == (2, 0, 2)
    # One failure policy: each crash is a recorded failure, with the problem and the program's words.
    assert [f.kind for f in stats.failures] == ["program_error"] * 2
    assert all("RuntimeError: boom" in f.message for f in stats.failures)

    async def sleeps(problem, ctx):
        await ctx.openai_client().chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "q"}])
        await asyncio.sleep(30)

    started = time.monotonic()
    tree, stats = run(engine, sleeps, tokenizer, width=1, env_timeout_s=0.3)
    assert (stats.program_timeouts, len(tree.leaves())) == (1, 0) and time.monotonic() - started < 10

    def hangs(problem, ctx):
        ctx.openai_client().chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "q"}])
        time.sleep(20)

    started = time.monotonic()
    tree, stats = run(engine, hangs, tokenizer, width=1, env_timeout_s=0.3)
    # The thread cannot be killed: it is left behind, and the step does not wait for it.
    assert stats.program_timeouts == 1 and time.monotonic() - started < 10

    async def bad_reward(problem, ctx):
        await ctx.openai_client().chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "q"}])
        return "high"

    tree, stats = run(engine, bad_reward, tokenizer, width=1)
    assert stats.program_errors == 1 and not tree.leaves()


def test_streaming_text_completions_and_the_key(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, [TOOL_CALL, "35"])
    seen: dict = {}

    async def program(problem, ctx):
        client = ctx.openai_client()
        messages = [{"role": "user", "content": problem["prompt"]}]
        stream = await client.chat.completions.create(model=ctx.model, messages=messages, stream=True)
        chunks = [chunk async for chunk in stream]
        seen["call"] = chunks[0].choices[0].delta.tool_calls[0].function.name
        seen["finish"] = chunks[-1].choices[0].finish_reason
        # A text prompt that extends the last call (prompt + answer as text) keeps its ids.
        text = tokenizer.decode(engine.requests[-1].input_ids) + TOOL_CALL + "<|im_end|>\n<|im_start|>assistant\n"
        completion = await client.completions.create(model=ctx.model, prompt=text, max_tokens=4, stop=["5"])
        seen["text"] = completion.choices[0].text
        stranger = ctx.openai_client(api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()

    tree, stats = run(engine, program, tokenizer)
    assert (seen["call"], seen["finish"]) == ("calculate", "tool_calls")
    assert seen["text"] == "3"  # "35" cut before the stop string, as OpenAI's
    assert stats.program_offpath_calls == 0 and len(tree.leaves()) == 1
    assert tokenizer.decode(tree.leaves()[0].token_ids) == "35"  # the ids cut at the stop, trained


def test_a_fork_point_samples_its_runs_in_one_request(tokenizer) -> None:
    """The runs starting at a fork point share one request (n = the runs): the engine computes
    their common prefix once, however the runs' calls interleave."""
    async def program(problem, ctx):
        client = ctx.openai_client()
        messages = [{"role": "user", "content": problem["prompt"]}]
        reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model=ctx.model, messages=messages)
        return 1.0

    for settings in ({"root_fork": 1, "branch": 4}, {"mode": "independent", "branch": 2}):
        engine = ScriptedEngine(tokenizer, ["12+23=35 \\boxed{35}", "yes"])
        tree, stats = run(engine, program, tokenizer, width=4, segment_tokens=64, max_depth=2, **settings)
        assert len(tree.leaves()) == 4 and stats.program_diverged == 0
        # Each run took an output of its own: the 4 leaves hold the 4 outputs of the shared request.
        forked = [n for n in tree.nodes() if n.loss_mask is None and n.logprobs[0] != -0.25]
        if settings.get("mode") == "independent":  # GRPO's group: 4 runs from the root, no replays
            assert stats.program_replayed_calls == 0
            assert [r.sampling.n for r in engine.requests] == [4, 1, 1, 1, 1]
            assert sorted(n.logprobs[0] for n in forked) == [-1.0, -0.75, -0.5]  # call 1's 2nd-4th outputs
        else:  # one run answers call 1; call 2 forks 4 ways: three replays, one request of n=4
            assert stats.program_replayed_calls == 3
            assert [r.sampling.n for r in engine.requests] == [1, 4]
            assert sorted(leaf.logprobs[0] for leaf in tree.leaves()) == [-1.0, -0.75, -0.5, -0.25]


def test_independent_runs_of_the_example_never_replay(tokenizer) -> None:
    from arbor.engines.embedded.engine import LocalEngine

    program = load_object("agents/openai_tool.py:program", "rollout.program", [str(ROOT)])
    tree, stats = run(LocalEngine(MODEL), program, tokenizer, mode="independent", width=4, branch=2,
                      segment_tokens=32, max_depth=4)
    assert len(tree.leaves()) == 4 and stats.program_calls == 12
    assert stats.program_replayed_calls == 0 and stats.program_diverged == 0
    # Four paths from the prompt: no two leaves share a sampled token.
    firsts = {id(tree.path(leaf)[0]) for leaf in tree.leaves()}
    assert len(firsts) == 4
