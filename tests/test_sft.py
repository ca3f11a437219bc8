"""arbor sft: data encoding, tree == linear gradients, a 2-rank ZeRO-3 run, resume, bad lines."""

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_learner import run_two_ranks
from tiny_model import build_tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from arbor.config import DataConfig, LearnerConfig, LossConfig, ModelConfig, OptimConfig
from arbor.config_load import load_config
from arbor.data import DataError
from arbor.errors import RunStopped
from arbor.run.metrics import read_metrics
from arbor.run.sft import (
    SftExample,
    _default_distributed_env,
    encode_example,
    load_examples,
    main,
    run_sft,
    sft_backward,
    step_batches,
)
from arbor.train.learner import Learner
from arbor.train.packed_loss import sft_loss
from arbor.tree import RolloutTree

VOCAB = 40
REPO = Path(__file__).resolve().parents[1]
hf_logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("sft") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny)


def encode(row, tokenizer, max_tokens=512):
    return encode_example(row, "f.jsonl:1", tokenizer, DataConfig(), chat_template=True, max_tokens=max_tokens)


# -- encoding ---------------------------------------------------------------------------------


def test_conversation_trains_assistant_turns_only(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "bye"}]
    example = encode({"messages": messages}, tokenizer)
    tree = example.tree
    (leaf,) = tree.leaves()
    decode = tokenizer.decode
    assert decode(tree.prompt_ids) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    trained = [t for t, m in zip(leaf.token_ids, leaf.loss_mask) if m]
    context = [t for t, m in zip(leaf.token_ids, leaf.loss_mask) if not m]
    # This tokenizer's EOS is <|endoftext|>, so the template's whole end of turn is trained.
    assert decode(trained) == "hello<|im_end|>\nbye<|im_end|>\n"
    assert decode(context) == "<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"
    assert decode(tree.full_ids(leaf)) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert example.weights == [1.0]


def test_conversation_stops_training_at_eos(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = "<|im_end|>"  # as in Qwen chat models: the end of turn is EOS
    (leaf,) = encode({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                     tok).tree.leaves()
    assert tok.decode(leaf.token_ids) == "yo<|im_end|>\n"
    assert leaf.loss_mask == [1] * (len(leaf.token_ids) - 1) + [0]  # the newline after EOS is not trained


def test_conversation_stops_training_at_a_generation_config_stop_token(tokenizer, tiny):
    """Qwen2.5-Instruct's case: the tokenizer's EOS is <|endoftext|> but generation_config.json
    ends turns on <|im_end|> too; training stops there as sampling does."""
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    example = encode_example(row, "f.jsonl:1", tokenizer, DataConfig(), True, 512, stop_ids=stop_ids)
    (leaf,) = example.tree.leaves()
    assert tokenizer.decode(leaf.token_ids) == "yo<|im_end|>\n"
    assert leaf.loss_mask == [1] * (len(leaf.token_ids) - 1) + [0]
    path = tiny.parent / "sft-stop.jsonl"
    path.write_text(json.dumps(row) + "\n")
    generation_config = tiny / "generation_config.json"
    saved = generation_config.read_text()  # the module's model is shared: put it back after
    generation_config.write_text(json.dumps({"eos_token_id": stop_ids}))
    try:  # load_examples reads the stop ids from the model directory
        (loaded,) = load_examples(path, tokenizer, DataConfig(), True, 512)
    finally:
        generation_config.write_text(saved)
    assert loaded.tree.leaves()[0].loss_mask == leaf.loss_mask


def test_tree_branches_share_prefixes_and_match_the_rl_prompt(tokenizer):
    from arbor.data import format_prompt

    data_cfg = DataConfig(prompt_suffix=" Answer.", system_prompt="sys")
    row = {"prompt": "What is 2+2?", "branches": ["it is 4", "it is four", "4"], "weight": [1, 2, 0.5]}
    example = encode_example(row, "f.jsonl:3", tokenizer, data_cfg, chat_template=True, max_tokens=512)
    tree = example.tree
    assert tree.prompt_ids == format_prompt({"id": "p", "prompt": "What is 2+2?"}, data_cfg, tokenizer, True)
    assert [tokenizer.decode(tree.response_ids(leaf)) for leaf in tree.leaves()] == [
        "it is 4<|endoftext|>", "it is four<|endoftext|>", "4<|endoftext|>"]
    assert tree.stats().unique_response_tokens < tree.stats().linearised_response_tokens  # "it is" once
    assert example.weights == [1.0, 2.0, 0.5]
    # A conversation with one exchange and the same tree with one branch train the same tokens.
    messages = [{"role": "user", "content": "What is 2+2?"}]
    as_tree = encode({"prompt": messages, "branches": ["4"]}, tokenizer).tree
    as_chat = encode({"messages": messages + [{"role": "assistant", "content": "4"}]}, tokenizer).tree
    assert as_tree.prompt_ids == as_chat.prompt_ids
    assert as_tree.leaves()[0].token_ids[:1] == as_chat.leaves()[0].token_ids[:1]


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"prompt": "q"}', "expected 'messages'"),
    ('{"messages": [], "branches": ["a"]}', "expected 'messages'"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
    ('{"messages": [{"role": "user"}]}', "message 0 must be an object"),
    ('{"messages": "hello"}', "non-empty list"),
    ('{"prompt": 3, "branches": ["a"]}', "'prompt' must be text or a list"),
    ('{"prompt": "q", "branches": []}', "non-empty list of texts"),
    ('{"prompt": "q", "branches": ["a", 1]}', "non-empty list of texts"),
    ('{"prompt": "q", "branches": ["a"], "weight": -1}', "'weight' must be a number ≥ 0"),
    ('{"prompt": "q", "branches": ["a", "b"], "weight": [1]}', "one number ≥ 0 per branch"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "starts with an assistant message"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "weight": [1]}',
     "'weight' must be a number"),
    ('{"prompt": "q", "branches": ["' + "word " * 200 + '"]}', "do not fit in a pack of learner.pack_tokens=64"),
])
def test_bad_lines_name_file_and_line(tmp_path, tokenizer, line, message):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"prompt": "q", "branches": ["a"]})
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(DataError, match=f"^{path}:3: .*{message}"):
        load_examples(path, tokenizer, DataConfig(), chat_template=True, max_tokens=64)


def test_messages_need_a_chat_template(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    with pytest.raises(DataError, match=f"^{path}:1: messages need a chat template"):
        load_examples(path, tokenizer, DataConfig(), chat_template=False, max_tokens=64)
    with pytest.raises(DataError, match="no such file"):
        load_examples(tmp_path / "missing.jsonl", tokenizer, DataConfig(), True, 64)


def test_step_batches_cover_every_epoch():
    cfg = load_config(None, ["sft.epochs=2", "sft.batch_size=4"]).sft
    batches = step_batches(10, cfg, seed=0)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(batches[:3], [])) == sorted(sum(batches[3:], [])) == list(range(10))
    assert batches[:3] != batches[3:]  # reshuffled
    cfg.max_steps = 4
    assert len(step_batches(10, cfg, seed=0)) == 4


# -- tree == linear --------------------------------------------------------------------------


def random_examples(seed: int) -> list[SftExample]:
    """Trees with shared prefixes of random depth, masked (context) segments and weights."""
    rng = random.Random(seed)
    examples = []
    for i in range(rng.randint(1, 4)):
        stem = [rng.randrange(VOCAB) for _ in range(6)]
        responses = [stem[: rng.randint(0, 6)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
                     for _ in range(rng.randint(1, 4))]
        tree = RolloutTree.from_sequences([rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))], responses,
                                          segment_tokens=rng.choice([None, 2, 3]), problem={"id": i})
        for node in tree.nodes():
            if rng.random() < 0.3:
                node.loss_mask = [rng.randint(0, 1) for _ in node.token_ids]
        examples.append(SftExample(tree, [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in tree.leaves()], f"f:{i}"))
    return examples


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), normalize=st.sampled_from(["token", "sequence"]),
       execution=st.sampled_from(["packed", "dfs"]))
def test_tree_sft_gradients_equal_linear_sft(seed, normalize, execution):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).double()
    reference = copy.deepcopy(model)
    examples = random_examples(seed)
    # A small pack budget: several packs, and trees split across them.
    learner = Learner(ModelConfig(), LearnerConfig(backend="torch", device="cpu", pack_tokens=16,
                                                   tree_execution=execution, dfs_group_tokens=5),
                      OptimConfig(), LossConfig(), total_steps=1, model=model)
    metrics = sft_backward(learner, examples, normalize)

    trees = [e.tree for e in examples]
    if not any(tree.num_trainable(leaf) for tree in trees for leaf in tree.leaves()):
        return  # nothing trained: no gradient to compare
    loss = sft_loss(reference, trees, [e.weights for e in examples], normalize=normalize, mode="padded")
    loss.backward()
    assert metrics["sft/loss"] == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    # Every token is forwarded at least once; a tree split over packs repeats its root-path
    # context, so with this small budget packing can even exceed the linearised count.
    assert metrics["sft/packed_tokens"] >= sum(t.stats().unique_tokens for t in trees)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # HF's RMSNorm computes in float32 even in a float64 model: compare to the scale.
        assert (p.grad - q.grad).abs().max() <= 1e-6 * q.grad.abs().max() + 1e-12, name


# -- the command ------------------------------------------------------------------------------


def write_data(path, n=8):
    rows = []
    for i in range(n):
        a, b = i % 4, i // 4
        if i % 2:
            rows.append({"messages": [{"role": "user", "content": f"add {a} {b}"},
                                      {"role": "assistant", "content": f"the sum is {a + b}"}]})
        else:
            rows.append({"prompt": f"add {a} {b}", "branches": [f"the sum is {a + b}", f"the sum is {a + b}!"],
                         "weight": 1.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(tmp_path, model, *lines):
    text = "\n".join([
        f"model: {{path: {model}}}",
        "learner: {device: cpu, dtype: float32, pack_tokens: 96}",
        "data: {max_prompt_tokens: 32}",
        "rollout: {segment_tokens: 32}",
        "optim: {lr: 0.003}",
        f"sft: {{train_path: {write_data(tmp_path / 'train.jsonl')}, batch_size: 8, epochs: 5}}",
        f"run: {{output_dir: {tmp_path / 'run'}, save_every: 0}}",
        *lines,
    ])
    (tmp_path / "sft.yaml").write_text(text + "\n")
    return tmp_path / "sft.yaml"


def test_two_zero3_ranks_lower_the_loss_and_export(tmp_path, tiny):
    config = write_config(tmp_path, tiny, "")
    logs = run_two_ranks("-m", "arbor", "sft", config)
    assert "step 5/5  loss" in logs[0] and "step 1/5" not in logs[1]  # rank 0 reports

    metrics = read_metrics(tmp_path / "run")
    losses = [m["sft/loss"] for m in metrics]
    assert len(losses) == 5 and losses[-1] < 0.6 * losses[0], losses
    # Two ranks, each on its share of the packs, train as one process does on the whole batch.
    single = run_sft(load_config(config, ["learner.backend=torch", f"run.output_dir={tmp_path / 'single'}"]))
    assert losses == pytest.approx([m["sft/loss"] for m in single], rel=1e-3)
    # The first step's loss (summed over ranks) is the whole batch's SFT loss of the initial model.
    cfg = load_config(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    examples = load_examples(cfg.sft.train_path, tokenizer, cfg.data, True, 96)
    with torch.no_grad():
        expected = sft_loss(AutoModelForCausalLM.from_pretrained(tiny), [e.tree for e in examples],
                            [e.weights for e in examples])
    assert losses[0] == pytest.approx(expected.item(), rel=1e-4)
    assert metrics[0]["sft/tokens"] == sum(e.tree.num_trainable(leaf) for e in examples for leaf in e.tree.leaves())
    assert metrics[0]["sft/lr"] == 0.003
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-000005"

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    with torch.no_grad():
        after = sft_loss(trained, [e.tree for e in examples], [e.weights for e in examples])
    assert after.item() < losses[-1] * 1.5
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "hf").chat_template == tokenizer.chat_template


def test_torch_backend_run_resumes(tmp_path, tiny, capsys):
    config = write_config(tmp_path, tiny, "")
    overrides = ["learner.backend=torch", "learner.zero_stage=0", "run.save_every=2", "run.loggers=[]"]
    assert main(load_config(config, overrides + ["sft.max_steps=2"])) == 0
    assert "step 2/2  loss" in capsys.readouterr().out
    with pytest.raises(RunStopped, match="already holds a run"):
        main(load_config(config, overrides + ["sft.max_steps=3"]))
    assert main(load_config(config, overrides + ["sft.max_steps=3", "run.resume=true"])) == 0
    out = capsys.readouterr().out
    assert "step 3/3" in out and "step 2/3" not in out
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert (tmp_path / "run" / "hf" / "config.json").exists()


def test_bad_data_exits_with_the_line(tmp_path, tiny, capsys):
    config = write_config(tmp_path, tiny, "")
    (tmp_path / "train.jsonl").write_text('{"prompt": "q", "branches": "a"}\n')
    assert main(load_config(config, ["learner.backend=torch"])) == 1
    assert f"{tmp_path / 'train.jsonl'}:1: 'branches' must be" in capsys.readouterr().err


def test_a_plain_process_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    _default_distributed_env(load_config(None, ["learner.device=cpu"]))
    assert [os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")] == ["0", "0", "1"]
    assert int(os.environ["MASTER_PORT"]) > 0
    monkeypatch.setenv("RANK", "1")  # set by a launcher: kept
    monkeypatch.setenv("WORLD_SIZE", "2")
    _default_distributed_env(load_config(None, ["learner.device=cpu"]))
    assert os.environ["RANK"] == "1" and os.environ["WORLD_SIZE"] == "2"


def test_the_sft_recipe_runs(tmp_path):
    """`arbor sft configs/sft.yaml` as shipped (its data, model and ZeRO-3 learner), two steps:
    the loss falls and the model is exported. A subprocess: DeepSpeed's rank variables stay there."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "arbor", "sft", "configs/sft.yaml", "sft.max_steps=2",
                           f"run.output_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "539 examples from data/arith-tool/sft.jsonl" in done.stdout
    first, second = read_metrics(out)
    assert second["sft/loss"] < first["sft/loss"]
    assert (out / "hf" / "model.safetensors").exists()
