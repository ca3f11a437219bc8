"""DeepSpeed start-up of a learner rank: the process group, the engine's config, Muon's import.

    init_distributed("gloo")                 # from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables
    ds_config = deepspeed_config(cfg.learner, cfg.optim, torch.bfloat16)
    import_muon_uncompiled()                 # before deepspeed.initialize
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch

from arbor.config import LearnerConfig, OptimConfig
from arbor.engines.interfaces import bind_collectives_towards
from arbor.train.zero3 import require_tested_deepspeed


def init_distributed(backend: str) -> None:
    """torch.distributed via DeepSpeed from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables."""
    import deepspeed

    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"DeepSpeed learner ranks need the environment variables {missing}")
    # The peers dial this rank at the address of the interface that reaches the rendezvous,
    # not the one gloo guesses from the host name (often loopback). A Ray rank has already
    # bound its node's address (arbor.run.learner_group); a user's GLOO_SOCKET_IFNAME wins.
    bind_collectives_towards(os.environ["MASTER_ADDR"])
    # DeepSpeed compiles a shared-memory op at first init on CPU (tens of seconds) that
    # training never uses: skip it, in the release where that hook was checked.
    require_tested_deepspeed("distributed start-up (comm.torch.build_shm_op)")
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def deepspeed_config(learner_cfg: LearnerConfig, optim_cfg: OptimConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a learner rank (the policy's engine and its ZeRO-3 construction)."""
    # overlap_comm is not supported with unmanaged accumulation under ZeRO-3.
    zero: dict[str, Any] = {"stage": learner_cfg.zero_stage, "overlap_comm": False}
    if learner_cfg.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if learner_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if learner_cfg.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Any number of packs per update: every step() is the accumulation boundary.
        "managed_gradient_accumulation": False,
        "gradient_clipping": optim_cfg.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # DeepSpeedCPUAdam compiles for minutes on CPU
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


# DeepSpeed 0.19's ZeRO optimizers import its Muon optimizer (to check whether ours is one),
# and that module torch.compiles its kernels as it is imported, which loads TorchInductor:
# more than half of a CPU rank's set-up on the quickstart, for kernels arbor never runs
# (its optimizer is AdamW). Imported first with TorchDynamo off (read at each torch.compile
# call, so only these decorators see it), the kernels stay plain functions.
_MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon kernels (when it has them) without compiling them."""
    if _MUON_MODULE in sys.modules:
        return
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(_MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to skip
        pass
    finally:
        if previous is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous
