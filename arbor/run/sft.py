"""``arbor sft CONFIG``: supervised fine-tuning on conversations or trees of branches, tree-packed.

    arbor sft configs/sft.yaml [section.key=value ...]                # one process
    torchrun --nproc_per_node 2 -m arbor sft configs/sft.yaml         # 2 data-parallel ranks
    deepspeed --hostfile hosts --module arbor sft configs/sft.yaml    # several nodes

Every process runs the same program (SPMD) under DeepSpeed ZeRO-3 (``learner.*``): it
reads the whole data file, takes the same batch each step, and trains on its share of
that batch's tree packs. The launchers set ``RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR
MASTER_PORT``; a plain ``arbor sft`` is world size 1. The ``--local_rank=N`` the
``deepspeed`` launcher appends is ignored (ranks read ``LOCAL_RANK``). ``learner.backend: torch``
is single-process; ``learner.num_ranks`` is the RL trainer's and is ignored here.

Data (``sft.train_path``), one JSON object a line, either

- a conversation ``{"messages": [{"role": "user", "content": "..."}, {"role":
  "assistant", "content": "..."}, ...]}``: rendered by the tokenizer's chat template as
  given; the loss is on the assistant turns only (their content and the template's
  end-of-turn tokens through the EOS token; template text after EOS is context), or
- a tree ``{"prompt": "..." or [messages], "branches": ["completion a", ...]}``: several
  completions of one prompt, each followed by the EOS token. A text prompt is formatted
  exactly as ``arbor train`` formats a problem (``model.chat_template``,
  ``data.system_prompt``, ``data.prompt_suffix``), a list of messages by the chat
  template with the generation prompt. Branches sharing a prefix become one tree
  (:meth:`RolloutTree.from_sequences`), so the prefix is computed once.

and optionally ``"weight"``: a number ≥ 0 scaling the example's terms of the loss (a tree
may give one per branch). The loss of a step is the NLL of every trained token of every
root-to-leaf path, divided by the batch's trained tokens (``sft.normalize: token``) or
paths (``sequence``): linear SFT's value and gradients, each shared prefix computed once.
An example must fit in ``learner.pack_tokens``. Bad lines fail before training with
``file:line`` and what is wrong.

Steps: ``sft.epochs`` passes over the data, ``sft.batch_size`` examples (over all ranks)
per optimizer step, at most ``sft.max_steps`` (``run.steps`` is RL's); ``optim.*`` is the
optimizer and schedule. Outputs under ``run.output_dir``: the loss of each step on rank
0's console, TensorBoard ``sft/loss``, ``sft/tokens`` (trained tokens, every path
counted), ``sft/packed_tokens`` (tokens forwarded), ``sft/lr``, ``sft/grad_norm``, the
same in ``metrics.jsonl``, checkpoints every ``run.save_every`` steps and at the end
(``run.resume`` continues the latest; nodes must share ``run.output_dir``), and the
final model as an HF directory in ``<output_dir>/hf``.

The step is a library function too (``scripts/build_tiny_model.py`` uses it):

    examples = load_examples(path, tokenizer, cfg.data, chat_template=True, max_tokens=4096)
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=100)
    metrics = sft_step(learner, examples[:32])        # {"sft/loss": ..., "sft/tokens": ...}
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from arbor.config import Config, DataConfig, SftConfig, config_to_dict
from arbor.data import DataError, format_prompt, read_rows, stop_token_ids
from arbor.engines.ports import free_port
from arbor.errors import ConfigError
from arbor.run import checkpoint
from arbor.run.metrics import MetricsLog
from arbor.run.startup import start_command
from arbor.train.dfs import pack_budget
from arbor.train.learner import Learner, resolve_device
from arbor.train.packed_loss import pack_sft_loss, sft_token_loss
from arbor.train.packing import Normalize, PackedBatch, loss_denominator
from arbor.train.rank_balance import rank_packs
from arbor.tree import RolloutTree

# -- examples -------------------------------------------------------------------------------


@dataclass
class SftExample:
    """One line of the data as a tree: a prompt and the continuations trained on it."""

    tree: RolloutTree  # one leaf per branch; a conversation is one leaf with non-assistant tokens masked
    weights: list[float]  # per leaf (tree.leaves() order), ≥ 0
    where: str  # file:line


def load_examples(
    path: str | Path, tokenizer: Any, data_cfg: DataConfig, chat_template: bool, max_tokens: int,
    stop_ids: Sequence[int] | None = None,
) -> list[SftExample]:
    """Every line of a jsonl file as an :class:`SftExample`; the first bad line raises DataError.
    An assistant turn is trained up to its last stop token (``stop_ids``, default
    :func:`arbor.data.stop_token_ids` of the tokenizer)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory (sft.train_path)")
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: sft.train_path must be a .jsonl file (one JSON object a line)")
    if stop_ids is None:
        stop_ids = stop_token_ids(tokenizer)  # once: it reads the model's config files
    examples = [
        encode_example(row, where, tokenizer, data_cfg, chat_template, max_tokens, stop_ids)
        for where, row in read_rows(path)
    ]
    if not examples:
        raise DataError(f"{path}: no examples in it")
    return examples


def encode_example(
    row: Any, where: str, tokenizer: Any, data_cfg: DataConfig, chat_template: bool, max_tokens: int,
    stop_ids: Sequence[int] | None = None,
) -> SftExample:
    """A conversation (``messages``) or a tree (``prompt`` + ``branches``) as token trees.
    ``stop_ids`` end assistant turns (default :func:`arbor.data.stop_token_ids`).

        encode_example({"prompt": "2+2?", "branches": ["4", "four"]}, "f:1", tok, DataConfig(), True, 512)
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: a line must be a JSON object, got {type(row).__name__}")
    if ("messages" in row) == ("branches" in row):
        raise DataError(
            f"{where}: expected 'messages' (a conversation) or 'prompt' and 'branches' (a tree); keys: {sorted(row)}"
        )
    if "messages" in row:
        stop = stop_token_ids(tokenizer) if stop_ids is None else stop_ids
        tree = _conversation_tree(row["messages"], where, tokenizer, chat_template, set(stop))
    else:
        tree = _branch_tree(row, where, tokenizer, data_cfg, chat_template)
    weights = _weights(row.get("weight", 1.0), len(tree.leaves()), where, per_branch="branches" in row)
    longest = len(tree.prompt_ids) + max(leaf.end for leaf in tree.leaves())
    if longest > max_tokens:
        raise DataError(
            f"{where}: {longest} tokens (prompt + longest completion) do not fit in a pack of "
            f"learner.pack_tokens={max_tokens}"
        )
    return SftExample(tree, weights, where)


def _branch_tree(row: dict, where: str, tokenizer: Any, data_cfg: DataConfig, chat_template: bool) -> RolloutTree:
    prompt, branches = row.get("prompt"), row["branches"]
    if isinstance(prompt, str):
        # As `arbor train` formats a problem; the length limit here is learner.pack_tokens.
        unlimited = dataclasses.replace(data_cfg, max_prompt_tokens=sys.maxsize)
        prompt_ids = format_prompt({"id": where, "prompt": prompt}, unlimited, tokenizer, chat_template)
    elif isinstance(prompt, list):
        prompt_ids = _tokens(_render(_messages(prompt, where), where, tokenizer, chat_template, True), tokenizer)
    else:
        raise DataError(f"{where}: 'prompt' must be text or a list of messages, got {type(prompt).__name__}")
    if not prompt_ids:
        raise DataError(f"{where}: the prompt has no tokens (the first completion token needs one before it)")
    if not isinstance(branches, list) or not branches or not all(isinstance(b, str) for b in branches):
        raise DataError(f"{where}: 'branches' must be a non-empty list of texts")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    responses = [_tokens(b, tokenizer) + eos for b in branches]
    if not all(responses):
        raise DataError(f"{where}: a branch has no tokens (and the tokenizer has no EOS token to end it)")
    return RolloutTree.from_sequences(prompt_ids, responses, problem={"id": where})


def _conversation_tree(messages: Any, where: str, tokenizer: Any, chat_template: bool, stop_ids: set[int]) -> RolloutTree:
    """The rendered conversation as a one-leaf tree: the prompt up to the first assistant
    turn, then everything else with a loss mask of 1 on assistant tokens only (up to the
    turn's last id in ``stop_ids``)."""
    messages = _messages(messages, where)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    if turns[0] == 0:
        raise DataError(f"{where}: the conversation starts with an assistant message (its first token needs context)")
    # Text pieces (context, assistant turn, context, ...): what precedes each assistant turn
    # (with the generation prompt) and the turn. Tokenised one by one, as the model sees
    # them when it generates: a turn starts right after its generation prompt.
    pieces: list[tuple[str, bool]] = []
    rendered = ""
    for i in turns:
        before = _render(messages[:i], where, tokenizer, chat_template, True)
        after = _render(messages[: i + 1], where, tokenizer, chat_template, False)
        if not before.startswith(rendered) or not after.startswith(before):
            raise DataError(
                f"{where}: the chat template does not render this conversation turn by turn (a later "
                "turn changes the text of an earlier one); give each assistant turn its own line"
            )
        pieces += [(before[len(rendered):], False), (after[len(before):], True)]
        rendered = after
    prompt_ids = _tokens(pieces[0][0], tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    for text, assistant in pieces[1:]:
        piece = _tokens(text, tokenizer)
        trained = len(piece) if assistant else 0
        ends = [i for i, t in enumerate(piece) if t in stop_ids]
        if assistant and ends:
            # The turn ends at its stop token; template text after it (a newline) is not generated.
            trained = ends[-1] + 1
        ids += piece
        mask += [1] * trained + [0] * (len(piece) - trained)
    tree = RolloutTree(prompt_ids, problem={"id": where})
    tree.add_segment(tree.root, ids, loss_mask=mask)
    return tree


def _messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{'role': ..., 'content': ...}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with text 'role' and 'content', got {m!r:.80}")
    return messages


def _render(messages: list[dict], where: str, tokenizer: Any, chat_template: bool, generation_prompt: bool) -> str:
    from jinja2 import TemplateError

    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        raise DataError(f"{where}: messages need a chat template (model.chat_template: true and a tokenizer with one)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as e:
        raise DataError(f"{where}: the chat template rejects these messages: {e}") from None


def _tokens(text: str, tokenizer: Any) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _weights(weight: Any, leaves: int, where: str, per_branch: bool) -> list[float]:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

    if per_branch and isinstance(weight, list):
        # from_sequences keeps one leaf per branch, in order.
        if len(weight) != leaves or not all(map(number, weight)):
            raise DataError(f"{where}: 'weight' as a list needs one number ≥ 0 per branch ({leaves}), got {weight!r:.80}")
        return [float(w) for w in weight]
    if not number(weight):
        raise DataError(f"{where}: 'weight' must be a number ≥ 0, got {weight!r:.80}")
    return [float(weight)] * leaves


# -- one optimizer step -----------------------------------------------------------------------


def sft_backward(learner: Learner, examples: Sequence[SftExample], normalize: Normalize = "token") -> dict[str, float]:
    """Accumulate this rank's share of the gradient of the batch ``examples`` (the same list
    on every rank); ``sft/loss`` of this rank's packs and the batch's token counts."""
    trees = [e.tree for e in examples]
    denominator = max(loss_denominator(trees, normalize), 1e-12)
    # Every rank packs the whole batch's shares (balanced by tokens) and trains its own.
    ranks = learner.world_size if _distributed(learner) else 1
    budget = pack_budget(learner.cfg.tree_execution, learner.cfg.pack_tokens)  # dfs: whole trees
    per_rank, _ = rank_packs(trees, None, ranks, pack_tokens=budget, normalize=normalize,
                             loss_weights=[e.weights for e in examples], require_logprobs=False)
    mine = per_rank[learner.rank if ranks > 1 else 0]
    packs = [pack for share in per_rank for pack in share]

    def loss_of(model: Any, pack: PackedBatch) -> tuple[torch.Tensor, float]:
        loss = pack_sft_loss(model, pack, denominator, learner.attention, learner.cfg.logit_chunk_tokens)
        return loss, float(loss.detach())

    def token_loss(pack: PackedBatch, tokens: torch.Tensor, logp: torch.Tensor, *_: Any) -> tuple[torch.Tensor, float]:
        loss = sft_token_loss(pack, tokens, logp, denominator)
        return loss, float(loss.detach())

    if learner.cfg.tree_execution == "dfs":  # each pack walked depth first, group by group
        loss = sum(learner.dfs_backward(mine, token_loss), 0.0)
    else:  # any pack can fill a rank's idle passes: every rank holds them all
        loss = sum(learner.backward(mine, loss_of, filler=packs[0]), 0.0)
    return {
        "sft/loss": loss,
        "sft/tokens": loss_denominator(trees, "token"),
        "sft/packed_tokens": float(sum(p.num_tokens for p in packs)),
    }


def sft_step(learner: Learner, examples: Sequence[SftExample], normalize: Normalize = "token") -> dict[str, float]:
    """One optimizer update on the batch ``examples`` (the same list on every rank).

    Returns the batch's ``sft/loss`` (summed over ranks), ``sft/tokens`` (trained tokens,
    linearised), ``sft/packed_tokens`` (tokens forwarded), ``sft/lr`` (the rate this
    update used) and ``sft/grad_norm`` (before clipping).
    """
    metrics = sft_backward(learner, examples, normalize)
    metrics["sft/lr"] = learner.current_lr()
    metrics["sft/grad_norm"] = learner.optimizer_step()
    if _distributed(learner):
        total = torch.tensor([metrics["sft/loss"]], dtype=torch.float64, device=learner.device)
        torch.distributed.all_reduce(total)
        metrics["sft/loss"] = float(total.item())
    return metrics


def _distributed(learner: Learner) -> bool:
    return learner.engine is not None and learner.world_size > 1


def step_batches(num_examples: int, sft_cfg: SftConfig, seed: int) -> list[list[int]]:
    """Example indices of every optimizer step: each epoch in a (seeded) order, cut into
    ``batch_size`` chunks (an epoch's last one may be shorter), at most ``max_steps``."""
    batches = []
    for epoch in range(sft_cfg.epochs):
        order = list(range(num_examples))
        if sft_cfg.shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        batches += [order[i:i + sft_cfg.batch_size] for i in range(0, num_examples, sft_cfg.batch_size)]
    return batches[: sft_cfg.max_steps] if sft_cfg.max_steps else batches


# -- the command --------------------------------------------------------------------------------


def main(cfg: Config) -> int:
    try:
        history = run_sft(cfg)
    except DataError as e:
        print(f"arbor sft: {e}", file=sys.stderr)
        return 1
    if history and int(os.environ.get("RANK", "0")) == 0:
        print(f"arbor sft: done; loss {history[-1]['sft/loss']:.4f}; model in {Path(cfg.run.output_dir) / 'hf'}")
    return 0


def run_sft(cfg: Config) -> list[dict[str, float]]:
    """Train ``cfg`` (or resume it); returns the metrics of the steps this call ran."""
    _default_distributed_env(cfg)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.learner.backend == "torch" and world_size > 1:
        raise ConfigError(f"learner.backend: torch is single-process, but WORLD_SIZE is {world_size}; "
                         "use learner.backend: deepspeed")
    # Every rank settles and checks; rank 0 writes config.yaml.
    started = start_command(cfg, "sft", writes=rank == 0)
    cfg, tokenizer, previous = started.cfg, started.tokenizer, started.previous
    out = Path(cfg.run.output_dir)
    examples = load_examples(cfg.sft.train_path, tokenizer, cfg.data, cfg.model.chat_template,
                             max_tokens=cfg.learner.pack_tokens, stop_ids=started.stop_ids)
    batches = step_batches(len(examples), cfg.sft, cfg.run.seed)
    if resolve_device(cfg.learner.device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(cfg.run.seed)
    # SFT has no reference model: a kl_coef in the shared config must not load one.
    learner = Learner(cfg.model, cfg.learner, cfg.optim, dataclasses.replace(cfg.loss, kl_coef=0.0),
                      total_steps=len(batches))
    start = 0
    if previous is not None:
        learner.load(previous / "learner")
        start = int(checkpoint.read_driver_state(previous)["step"])
    log = None
    if rank == 0:
        # MetricsLog's console line shows RL metrics; the SFT line is printed below.
        log = MetricsLog(cfg.run, len(batches), stream=open(os.devnull, "w"),  # noqa: SIM115 (closed with log)
                         config=config_to_dict(cfg))
        le = cfg.learner
        print(f"arbor sft: {len(examples)} examples from {cfg.sft.train_path}; steps {start + 1}..{len(batches)}, "
              f"{cfg.sft.batch_size} examples each, {world_size} rank(s), "
              + (f"DeepSpeed ZeRO-{le.zero_stage}" if le.backend == "deepspeed" else "plain torch")
              + f" -> {out}", flush=True)
    history = []
    for step in range(start + 1, len(batches) + 1):
        with log.phase("train") if log else nullcontext():
            metrics = sft_step(learner, [examples[i] for i in batches[step - 1]], cfg.sft.normalize)
        if log is not None:
            metrics = log.write(step, metrics)
            print(f"step {step}/{len(batches)}  loss {metrics['sft/loss']:.4f}  tokens {metrics['sft/tokens']:.0f}  "
                  f"lr {metrics['sft/lr']:.1e}  gnorm {metrics['sft/grad_norm']:.3f}  {metrics['time/step_s']:.1f} s",
                  flush=True)
        history.append(metrics)
        if step == len(batches) or (cfg.run.save_every and step % cfg.run.save_every == 0):
            _save_checkpoint(learner, out, step, rank, cfg.run.keep_checkpoints)
    learner.export_hf(out / "hf", tokenizer)
    learner.close()
    if log is not None:
        log.stream.close()
        log.close()
    return history


def _save_checkpoint(learner: Learner, out: Path, step: int, rank: int, keep: int) -> None:
    directory = checkpoint.step_dir(out, step)
    learner.save(directory / "learner")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's shard is on disk before `latest` names it
    if rank == 0:
        checkpoint.write_driver_state(directory, {"step": step})
        checkpoint.mark_latest(out, step, keep=keep)


def _default_distributed_env(cfg: Config) -> None:
    """A plain ``arbor sft`` is rank 0 of 1; DeepSpeed still wants the launcher's variables."""
    if cfg.learner.backend == "deepspeed" and "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if resolve_device(cfg.learner.device).type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported; silences its guess
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.c10d_logger")

