"""A learner rank: the policy under DeepSpeed ZeRO-3 (or plain torch), stepping on tree packs.

    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=100,
                      temperature=cfg.rollout.temperature)
    denominator = loss_denominator(all_trees_of_the_step, cfg.loss.normalize)   # global
    packs = pack_trees(my_trees, my_advantages, pack_tokens=cfg.learner.pack_tokens)
    result = learner.step(packs, denominator)       # backward over every pack, one update
    result.stats.metrics(), result.grad_norm        # loss metrics of this rank's tokens

Log-probs are those of softmax(logits / T) with T the rollout temperature (the
distribution the engines sampled from), in float32 whatever the training dtype, with
the LM head run in chunks of ``learner.logit_chunk_tokens`` (:mod:`arbor.train.lm_head`).

Gradient accumulation is over packs: each pack's loss is already divided by the global
denominator (the whole batch over all ranks), so the summed gradient is exactly that of
the linearised batch. DeepSpeed averages gradients over data-parallel ranks; the loss is
multiplied by the world size to turn that average back into the sum.

Under ZeRO-3 the policy and the reference model are built partitioned over the ranks
(:mod:`arbor.train.zero3`): no rank ever holds a whole copy of either. Checkpoints and
:meth:`Learner.export_hf` still hold the whole model (gathered in ``learner.sync_bucket_mb``
buckets).

With ``model.lora_rank`` > 0 only a peft LoRA adapter trains (:mod:`arbor.train.lora`): the
optimizer holds the adapter alone, the KL reference is the policy with its adapter disabled
(no second copy), and checkpoints and exports hold the adapter in peft's format.

On CPU DeepSpeed talks gloo; ``backend: torch`` is a single-process learner for
debugging with the same loss and schedule.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from arbor.config import LearnerConfig, LossConfig, ModelConfig, OptimConfig
from arbor.train.deepspeed_setup import deepspeed_config, import_muon_uncompiled, init_distributed
from arbor.train.dfs import DfsWalk
from arbor.train.lm_head import check_temperature
from arbor.train.lockstep import IdleCalls, Lockstep
from arbor.train.logprobs import pack_token_logprobs
from arbor.train.lora import AdapterOff, adapter_state, add_adapter, save_adapter
from arbor.train.loss import LossStats
from arbor.train.packed_loss import PolicyObjective
from arbor.train.packing import PackedBatch
from arbor.train.rollout_correction import correction_of
from arbor.train.zero3 import build_partitioned, reference_engine, require_tested_deepspeed

R = TypeVar("R")
log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one learner rank returns from an update (across Ray): add ``stats`` over ranks."""

    stats: LossStats  # this rank's loss and metric sums (its packs only)
    grad_norm: float  # before clipping (the same on every rank)
    lr: float  # the learning rate this update used


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.device is cuda but no CUDA device is visible")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_policy(model_cfg: ModelConfig, dtype: torch.dtype, path: str | None = None) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        path or model_cfg.path, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code,
        attn_implementation="sdpa",
    )
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def lr_lambda(optim_cfg: OptimConfig, total_steps: int) -> Any:
    """Multiplier of the base lr at optimizer step s: linear warmup, then the schedule."""
    warmup, floor = optim_cfg.warmup_steps, optim_cfg.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if optim_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if optim_cfg.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine

    return factor


class Learner:
    """One data-parallel rank of the policy (plus an optional frozen reference model)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        learner_cfg: LearnerConfig,
        optim_cfg: OptimConfig,
        loss_cfg: LossConfig,
        total_steps: int,
        model: PreTrainedModel | None = None,
        temperature: float = 1.0,
    ) -> None:
        self.cfg, self.loss_cfg = learner_cfg, loss_cfg
        self.correction = correction_of(loss_cfg)  # loss.rollout_correction*
        check_temperature(temperature)  # log-probs are scored at the sampling temperature
        self.temperature = temperature
        self.device = resolve_device(learner_cfg.device)
        self.dtype = resolve_dtype(learner_cfg.dtype, self.device)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.attention = learner_cfg.attention
        ds_config = deepspeed_config(learner_cfg, optim_cfg, self.dtype)
        # ZeRO-3 builds the models partitioned (arbor.train.zero3): no rank holds a whole copy.
        sharded = learner_cfg.backend == "deepspeed" and learner_cfg.zero_stage == 3
        if learner_cfg.backend == "deepspeed":
            init_distributed("nccl" if self.device.type == "cuda" else "gloo")
        # Any: transformers types .to() on a model as if it could return something else.
        policy: Any
        if model is not None:
            policy = model
        elif sharded:
            policy = build_partitioned(model_cfg, self.dtype, ds_config)
        else:
            policy = load_policy(model_cfg, self.dtype)
        self.lora = model_cfg.lora_rank > 0
        if self.lora:
            policy = add_adapter(policy, model_cfg)  # freezes the base: only the adapter trains
        self.ref_model: Any = None  # with LoRA set below, once the policy's module is final
        self._ref_engine: Any = None  # under ZeRO-3 the DeepSpeed engine that shards ref_model
        full_reference = loss_cfg.kl_coef > 0 and not self.lora  # a LoRA run's reference: AdapterOff
        if full_reference and sharded:
            self._ref_engine = reference_engine(model_cfg, self.dtype, ds_config)
            self.ref_model = self._ref_engine.module
        elif full_reference:
            self.ref_model = cast(Any, load_policy(model_cfg, self.dtype, model_cfg.ref_path)).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        trained = [p for p in policy.parameters() if p.requires_grad]  # with LoRA: the adapter alone
        optimizer = torch.optim.AdamW(
            trained, lr=optim_cfg.lr, betas=(optim_cfg.betas[0], optim_cfg.betas[1]), eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))
        self.max_grad_norm = optim_cfg.max_grad_norm
        if learner_cfg.backend == "deepspeed":
            import deepspeed

            require_tested_deepspeed("unmanaged gradient accumulation over packs")
            import_muon_uncompiled()  # before DeepSpeed imports (and compiles) it
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=policy, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
            )
            self.model = self.engine.module
        else:
            self.engine = None
            self.model = policy.to(self.device)
            self.optimizer, self.scheduler = optimizer, scheduler
        if self.lora and loss_cfg.kl_coef > 0:
            self.ref_model = AdapterOff(self.model)
        self.model.train()
        self.steps = 0

    # -- training --------------------------------------------------------------------------

    def backward(
        self,
        packs: Sequence[PackedBatch],
        loss_of: Callable[[Any, PackedBatch], tuple[torch.Tensor, R]],
        filler: PackedBatch | None = None,
    ) -> list[R]:
        """Accumulate the gradients of ``loss_of(model, pack)`` over ``packs`` (this rank's share
        of one update); the records it returned with each loss, pack by pack.

        ``loss_of`` returns a loss already divided by its global denominator and a record of
        it (:meth:`policy_pack_loss`'s :class:`~arbor.train.loss.LossStats`, SFT's loss value).
        ``model`` is the DeepSpeed engine when there is one: DeepSpeed's forward advances the
        ZeRO-3 micro-step counter, without which each backward overwrites the last one's
        gradients instead of accumulating them. ``filler``: a pack for zero-loss passes when
        this rank has none (fewer packs than ranks); ZeRO-3 needs every rank in every forward.
        """
        records: list[R] = []
        scale = float(self.world_size) if self.engine is not None else 1.0
        for i in range(self._passes(len(packs), filler)):
            # ZeRO-3 gathers parameters collectively in every forward, so ranks with fewer
            # packs run extra passes on a pack of theirs with the loss zeroed.
            idle = i >= len(packs)
            pack = packs[min(i, len(packs) - 1)] if packs else filler
            assert pack is not None  # a rank without packs is given the filler
            loss, record = loss_of(self.engine or self.model, pack)
            if idle:
                loss = loss * 0.0
            else:
                records.append(record)
            if self.engine is not None:
                # DeepSpeed averages gradients over data-parallel ranks: × world size makes it the sum.
                self.engine.backward(loss * scale)
            else:
                loss.backward()
        return records

    def policy_pack_loss(
        self, model: Any, pack: PackedBatch, denominator: float, behaviour_cap: float | None = None
    ) -> tuple[torch.Tensor, LossStats]:
        """:func:`~arbor.train.packed_loss.pack_loss` with this learner's loss settings (``loss.*``);
        the pack's metric sums as plain floats (its graph is not kept past the backward).
        ``behaviour_cap``: the decoupled off-policy objective's cap (None: on-policy PPO)."""
        select = pack.trained.nonzero()[:, 0]
        scoring: dict[str, Any] = dict(temperature=self.temperature, chunk_tokens=self.cfg.logit_chunk_tokens)
        logp, entropy = pack_token_logprobs(model, pack, select, self.attention, **scoring)
        ref_logp = None
        if self.ref_model is not None and self.loss_cfg.kl_coef:
            with torch.no_grad():
                ref_logp = pack_token_logprobs(self.ref_model, pack, select, self.attention, **scoring)[0]
        return self.policy_objective(denominator, behaviour_cap).with_stats(pack, select, logp, entropy, ref_logp)

    def old_logprobs(self, packs: Sequence[PackedBatch], filler: PackedBatch | None = None) -> list[torch.Tensor]:
        """π_old of ``loss.rollout_correction``: this rank's log-probs of each pack's trained tokens
        (``pack.trained`` order; float64 on CPU), from the current weights without a graph.

        The same forward as training's (mode, temperature, LM-head chunks), so with one update
        per batch the PPO ratio π_θ/π_old starts at 1. Every rank runs as many passes as the
        rank with the most packs (ZeRO-3 gathers parameters collectively in each forward).
        """
        out: list[torch.Tensor] = []
        with torch.no_grad():
            if self.cfg.tree_execution == "dfs":  # idle passes (None) keep the ranks in step
                scored = [self._dfs_logprobs(self.model, packs[i] if i < len(packs) else None)
                          for i in range(self._passes(len(packs), needs_filler=False))]
                return [logp for logp in scored if logp is not None]
            for i in range(self._passes(len(packs), filler)):
                pack = packs[min(i, len(packs) - 1)] if packs else filler
                assert pack is not None  # _passes is 0 without packs and filler
                select = pack.trained.nonzero()[:, 0]
                logp, _ = pack_token_logprobs(self.model, pack, select, self.attention, temperature=self.temperature,
                                              chunk_tokens=self.cfg.logit_chunk_tokens)
                if i < len(packs):
                    out.append(logp.to(device="cpu", dtype=torch.float64))
        return out

    def _passes(self, n: int, filler: PackedBatch | None = None, needs_filler: bool = True) -> int:
        """Forward/backward passes this rank runs: the most packs any rank has. A rank without
        packs runs packed passes on ``filler``; depth-first idle passes (``needs_filler`` False)
        run one-token calls instead."""
        if self.engine is None or self.world_size == 1:
            return n
        if n == 0 and filler is None and needs_filler:
            raise ValueError("a learner rank without packs needs a filler pack for its idle passes")
        count = torch.tensor([n], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        return int(count.item())

    # -- depth-first execution (learner.tree_execution: dfs) -------------------------------------

    def dfs_backward(self, packs: Sequence[PackedBatch], objective: Callable[..., tuple[torch.Tensor, R]],
                     with_reference: bool = False) -> list[R]:
        """:meth:`backward`, each pack walked depth first (:class:`~arbor.train.dfs.DfsWalk`).

        ``objective(pack, tokens, logp, entropy, ref_logp)``: the loss (over the global
        denominator) of any of the pack's trained ``tokens`` and a record of it; it is called
        group by group and the records are returned in that order. ``with_reference``: the KL
        reference's log-probs (``ref_logp``) come from the same walk on it, without a graph.
        Under DeepSpeed the ranks run their walks in lockstep (:mod:`arbor.train.lockstep`).
        """
        model = self.engine or self.model
        backward: Callable[[torch.Tensor], Any] = self.engine.backward if self.engine is not None else torch.Tensor.backward
        lockstep = Lockstep(self.engine is not None and self.world_size > 1)
        idle = IdleCalls(model, backward)
        if self.engine is not None:
            lockstep.warm_up(idle)
        records: list[R] = []
        for i in range(self._passes(len(packs), needs_filler=False)):
            pack = packs[i] if i < len(packs) else None
            ref = self._dfs_logprobs(self.ref_model, pack) if with_reference else None
            walk = pack and DfsWalk(model, pack, pack.trained.nonzero()[:, 0], **self._dfs_settings(),
                                    token_loss=functools.partial(objective, pack), reference=ref, backward=backward,
                                    scale=float(self.world_size) if self.engine is not None else 1.0,
                                    anchor_every_backward=lockstep.distributed)
            lockstep.run(walk.ops() if walk else None, walk.calls() if walk else "", idle)
            records += walk.records if walk else []
        return records

    def _dfs_logprobs(self, model: Any, pack: PackedBatch | None) -> torch.Tensor | None:
        """log p of ``pack``'s trained tokens on the depth-first walk without a graph ([M] float64,
        CPU); with ``pack`` None an idle pass (under DeepSpeed, in step with the other ranks)."""
        walk = None
        if pack is not None:
            walk = DfsWalk(model, pack, pack.trained.nonzero()[:, 0], **self._dfs_settings())
        with torch.no_grad():
            Lockstep(self.engine is not None and self.world_size > 1).run(
                walk.ops() if walk else None, walk.calls() if walk else "", IdleCalls(model))
        return walk.logp if walk else None

    def _dfs_settings(self) -> dict[str, Any]:
        return dict(group_tokens=self.cfg.dfs_group_tokens, temperature=self.temperature,
                    chunk_tokens=self.cfg.logit_chunk_tokens)

    def policy_objective(self, denominator: float, behaviour_cap: float | None = None) -> PolicyObjective:
        """This learner's loss settings (``loss.*``) over the global ``denominator``."""
        lo = self.loss_cfg
        return PolicyObjective(denominator, lo.clip_low, lo.clip_high, lo.kl_coef, lo.kl_estimator,
                               lo.entropy_coef, behaviour_cap, self.correction)

    def optimizer_step(self) -> float:
        """Clip, update, advance the schedule; returns the gradient norm before clipping.

        A NaN or infinite norm is warned about naming the update (and, without DeepSpeed,
        the parameters whose gradients are not finite); the caller counts it
        (``train/nonfinite_grad_norms``). Without DeepSpeed that update is skipped: applying
        it would make every weight NaN. DeepSpeed decides for itself (it has stepped already)."""
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
            if not math.isfinite(grad_norm):
                log.warning("learner update %d: gradient norm is %s%s (parameters not named: DeepSpeed "
                            "holds the gradients partitioned)", self.steps, grad_norm,
                            "" if norm is not None else " (DeepSpeed reported none)")
        else:
            named = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
            norms = [g.detach().norm() for _, g in named]  # one pass, as clipping does anyway
            total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
            grad_norm = float(total)
            if math.isfinite(grad_norm):
                if self.max_grad_norm > 0:
                    torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.max_grad_norm, total)
                self.optimizer.step()
            else:
                bad = [name for (name, _), n in zip(named, norms) if not torch.isfinite(n)]
                log.warning("learner update %d: gradient norm is %s; non-finite gradients in %d parameter(s): %s; "
                            "the update is skipped", self.steps, grad_norm, len(bad),
                            ", ".join(bad[:8]) + (", ..." if len(bad) > 8 else ""))
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return grad_norm

    def step(
        self, packs: Sequence[PackedBatch], denominator: float, filler: PackedBatch | None = None,
        behaviour_cap: float | None = None,
    ) -> StepResult:
        """One optimizer update over ``packs``: the policy loss's sums of this rank's tokens
        (add them over ranks), the gradient norm and the learning rate it used.
        ``behaviour_cap``: off-policy batches' decoupled objective (:meth:`policy_pack_loss`)."""
        if self.cfg.tree_execution == "dfs":
            records = self.dfs_backward(packs, self.policy_objective(denominator, behaviour_cap).with_stats,
                                        with_reference=self.ref_model is not None and self.loss_cfg.kl_coef > 0)
        else:
            loss_of = functools.partial(self.policy_pack_loss, denominator=denominator, behaviour_cap=behaviour_cap)
            records = self.backward(packs, loss_of, filler)
        stats = sum(records, LossStats())
        lr = self.current_lr()  # the rate this update uses
        return StepResult(stats=stats, grad_norm=self.optimizer_step(), lr=lr)

    # -- checkpoints and export ----------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Model, optimizer and schedule state of this rank (every rank calls it)."""
        directory = Path(directory)
        if self.lora:  # the adapter in peft's format too, readable without arbor
            self.export_hf(directory / "adapter")
        if self.engine is not None:
            # With LoRA the frozen base is not state: the run rebuilds it from model.path.
            self.engine.save_checkpoint(str(directory), tag="learner", save_latest=False,
                                        exclude_frozen_parameters=self.lora)
            return
        directory.mkdir(parents=True, exist_ok=True)
        model_state = dict(self._trained_named_tensors())
        torch.save(
            {"model": model_state, "optimizer": self.optimizer.state_dict(),
             "scheduler": self.scheduler.state_dict(), "steps": self.steps},
            directory / "learner.pt",
        )

    def load(self, directory: str | Path) -> None:
        directory = Path(directory)
        if self.engine is not None:
            path, _ = self.engine.load_checkpoint(str(directory), tag="learner", load_module_strict=not self.lora)
            if path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}/learner")
            self.steps = int(self.scheduler.last_epoch)
            return
        state = torch.load(directory / "learner.pt", map_location=self.device, weights_only=True)
        if self.lora:  # adapter tensors only: every one of them must be there
            missing = sorted(set(dict(self._trained_named_tensors())) - set(state["model"]))
            if missing:
                raise KeyError(f"{directory}/learner.pt lacks adapter tensors {missing[:3]} "
                               "(a full fine-tuning checkpoint?)")
        self.model.load_state_dict(state["model"], strict=not self.lora)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])

    def close(self) -> None:
        """End this rank: release the models and engines, then the distributed group if any.

        A rank process (``arbor sft`` on several ranks, a script) should call it before it
        exits. Without it, a finished ZeRO-3 rank aborted at exit about one run in six
        ("terminate called without an active exception", exit -6), likely gloo work still
        ending while the interpreter tore down; with it, rarely (cause unproven). The learner
        is unusable afterwards.

        The ranks meet at a barrier first, so none tears its groups down while another still
        talks to it (rank 0 also hosts the rendezvous store). DeepSpeed keeps its own clone of
        the world group (ZeRO-3 gathers on it), which torch's ``destroy_process_group`` shuts
        down but leaves DeepSpeed holding; DeepSpeed's own ``destroy_process_group`` releases it.
        (ZeRO-3's partitioned parameters still refer to the groups, so their gloo threads
        live on until the process exits: measured with DeepSpeed 0.19.8 and torch 2.13.)
        """
        for name in ("engine", "_ref_engine", "ref_model", "model", "optimizer", "scheduler"):
            self.__dict__.pop(name, None)
        gc.collect()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            if self.cfg.backend == "deepspeed":
                import deepspeed.comm

                deepspeed.comm.destroy_process_group()
            else:
                torch.distributed.destroy_process_group()
            gc.collect()

    def export_hf(self, directory: str | Path, tokenizer: Any = None) -> None:
        """An HF directory (safetensors + config + tokenizer) of the current weights; with
        LoRA the adapter in peft's format (``arbor export DIR --merge OUT`` merges it).

        Collective under ZeRO-3 (every rank calls it); rank 0 writes.
        """
        if self.lora:
            state = self.adapter_weights()
            if self.rank == 0:
                save_adapter(self.model, directory, state, tokenizer)
            return
        state = self._whole_parameters(keep=self.rank == 0)
        if self.rank != 0:
            return
        directory = Path(directory)
        self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters (gathered under ZeRO-3), on CPU, on every rank."""
        return self._whole_parameters(keep=True)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The whole LoRA adapter under peft's saved names, on CPU, on rank 0 ({} elsewhere;
        collective under ZeRO-3)."""
        whole = self._whole_parameters(keep=self.rank == 0, trainable_only=True)
        return adapter_state(self.model, whole) if self.rank == 0 else {}

    def _trained_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What a plain-torch checkpoint holds: every tensor, or with LoRA the adapter's."""
        if self.lora:
            return [(k, p.detach()) for k, p in self.model.named_parameters() if p.requires_grad]
        return list(self.model.state_dict().items())

    def _whole_parameters(self, keep: bool, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`full_state_dict` where ``keep``, else {} (a ZeRO-3 rank still takes part
        in every gather: ``learner.sync_bucket_mb`` buckets, one ``GatheredParameters`` each).
        ``trainable_only``: the parameters being trained (the LoRA adapter)."""
        if self.engine is None or self.cfg.zero_stage != 3:
            if not keep:
                return {}
            named = self._trained_named_tensors() if trainable_only else self.model.state_dict().items()
            return {k: v.detach().cpu().clone() for k, v in named}
        from arbor.train.weight_sync import gathered_buckets

        out: dict[str, torch.Tensor] = {}
        for bucket in gathered_buckets(self.model, 3, self.cfg.sync_bucket_mb, copy=keep,
                                       trainable_only=trainable_only):
            if keep:
                out.update((name, tensor.cpu()) for name, tensor in bucket)
        return out
