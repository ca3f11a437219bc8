"""LoRA adapters on the embedded engine: merged into the weights, the base kept for exactness.

    adapters = MergedAdapters(model)
    adapters.load("arbor-lora-3", "runs/x/weight-sync/arbor-lora-3")   # a peft directory
    adapters.check_requested(["arbor-lora-3"])                          # what /generate names
    adapters.unload("arbor-lora-2")

SGLang serves many adapters at once with LoRA kernels; this engine holds one set of
weights, so it merges the newest adapter: each target linear becomes
``W_base + (lora_alpha / r) · B A`` (``lora_alpha / √r`` with rsLoRA), computed in float32
from a copy of ``W_base`` kept the first time a module is merged. Every load starts from
that copy, so push after push the weights are exactly base + the current adapter, never
an accumulation of rounding. A full weight update replaces the base (of the modules it
sends) and the served adapter is merged on top again, as SGLang keeps adapters across one. The latest loaded adapter is the one served; requests may
name it or an adapter it superseded that is still loaded (a request sent just before the
client learnt of the new one): those run on the current weights, as after a full weight
update, and their outputs carry the current ``weight_version``.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from aiohttp import web

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<module>.lora_A.weight


Factors = tuple[float, torch.Tensor, torch.Tensor]  # scale, A [r, in], B [out, r] (float32)


def delta(factors: Factors) -> torch.Tensor:
    """The weight update ``scale · B A`` of one module: [out, in], float32."""
    scale, a, b = factors
    return scale * (b @ a)


def read_factors(directory: str | Path, model: torch.nn.Module) -> dict[str, Factors]:
    """Module name -> (scale, A, B) of a peft LoRA directory, checked against ``model``; every
    error names the directory and the tensor or config field."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise ValueError(f"{directory} is not a LoRA adapter directory: no {name}")
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    unsupported = {key: config[key] for key in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                                                "modules_to_save") if config.get(key)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if config.get("peft_type", "LORA") != "LORA" or unsupported:
        raise ValueError(f"{directory}/{ADAPTER_CONFIG}: only plain LoRA merges here, got "
                         f"peft_type={config.get('peft_type')!r} {unsupported}")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{directory}/{ADAPTER_WEIGHTS}: tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(module, {})[part[0]] = tensor
    modules = dict(model.named_modules())
    factors = {}
    for module, ab in pairs.items():
        linear = modules.get(module)
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"{directory}: adapter module {module!r} is not a linear layer of this model")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{directory}: adapter module {module!r} lacks lora_{({'A', 'B'} - set(ab)).pop()}")
        a, b = ab["A"].float(), ab["B"].float()  # [r, in], [out, r]
        if a.shape != (rank, linear.in_features) or b.shape != (linear.out_features, rank):
            raise ValueError(f"{directory}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; expected "
                             f"A ({rank}, {linear.in_features}), B ({linear.out_features}, {rank})")
        factors[module] = (scale, a, b)
    return factors


class MergedAdapters:
    """The adapters an embedded engine has loaded; the newest is merged into its weights.

    Not thread-safe: the engine calls it while it holds its weights exclusively.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: list[str] = []  # names, oldest first
        self.paths: dict[str, str] = {}
        self.active: str | None = None  # the adapter merged into the weights
        self._base: dict[str, torch.Tensor] = {}  # module -> its weight before any merge
        self._merged: dict[str, Factors] = {}  # module -> the served adapter's factors merged into it

    def load(self, name: str, path: str | Path) -> None:
        if not name:
            raise ValueError("lora_name must be a non-empty string")
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
        factors = read_factors(path, self.model)  # before any change: a bad adapter leaves all as it was
        self.restore_base()
        modules = dict(self.model.named_modules())
        for module in factors:
            self._base.setdefault(module, modules[module].weight.detach().clone())
        self._merged = factors
        self._merge(list(factors))
        self.loaded.append(name)
        self.paths[name] = str(path)
        self.active = name

    def unload(self, name: str) -> None:
        """Forget ``name``; unloading the served adapter restores the base weights."""
        if name not in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {self.loaded})")
        self.loaded.remove(name)
        del self.paths[name]
        if name == self.active:
            self.restore_base()

    def restore_base(self) -> None:
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for module in self._merged:
                modules[module].weight.copy_(self._base[module])
        self._merged = {}
        self.active = None

    def rebase(self, parameter_names: list[str]) -> None:
        """These parameters were just overwritten with new base weights (a full weight update,
        as SGLang's, keeps the adapters): they become the base, the served adapter is merged
        on top again."""
        modules = dict(self.model.named_modules())
        updated = [name.removesuffix(".weight") for name in parameter_names if name.endswith(".weight")]
        updated = [module for module in updated if module in self._base]
        for module in updated:
            self._base[module] = modules[module].weight.detach().clone()
        self._merge([module for module in updated if module in self._merged])

    def _merge(self, names: list[str]) -> None:
        """weight = base + the served adapter's delta, for the modules ``names``."""
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for module in names:
                weight, base = modules[module].weight, self._base[module]
                weight.copy_((base.float() + delta(self._merged[module]).to(base.device)).to(weight.dtype))

    def check_requested(self, names: list[str | None]) -> None:
        """Refuse a request naming an adapter that is not loaded, or any adapter while the
        base weights are served (its superseding adapter was unloaded)."""
        for name in names:
            if name is None:
                if self.active is not None:
                    raise ValueError(f"this engine serves LoRA adapter {self.active!r} merged into its weights: "
                                     "requests must name it (lora_path); the base model is not served meanwhile")
                continue
            if name not in self.paths:
                raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {self.loaded})")
            if self.active is None:
                raise ValueError(f"LoRA adapter {name!r} is loaded but the engine serves its base weights "
                                 "(the adapter that superseded it was unloaded): load it again")


def add_lora_routes(routes: Any, engine: Any, handler: Callable, refused: Callable[[str], Any]) -> None:
    """SGLang's ``POST /load_lora_adapter`` ``{lora_name, lora_path}`` and ``/unload_lora_adapter``
    ``{lora_name}`` on ``arbor serve``'s routes for ``engine`` (a ``LocalEngine``); ``handler``
    turns the ValueErrors of bad requests into 400s."""
    from aiohttp import web

    async def fields(request: web.Request, *names: str) -> list[str]:
        body = await request.json()  # malformed JSON: a ValueError, so a 400
        values = [body.get(name) if isinstance(body, dict) else None for name in names]
        strings = [v for v in values if isinstance(v, str)]
        if len(strings) != len(values):
            raise ValueError(f"{' and '.join(names)} must be strings")
        return strings

    async def adapters_changed(change: Any, *args: str) -> web.Response:
        """Run a LoRA change off the event loop; SGLang's answer (loaded adapters, or 400)."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, change, *args)
        except (OSError, ValueError) as exc:
            return refused(str(exc))
        return web.json_response({"success": True, "loaded_adapters": dict(engine.adapters.paths)})

    @routes.post("/load_lora_adapter")
    @handler
    async def load_lora_adapter(request: web.Request) -> web.Response:
        return await adapters_changed(engine.load_adapter, *await fields(request, "lora_name", "lora_path"))

    @routes.post("/unload_lora_adapter")
    @handler
    async def unload_lora_adapter(request: web.Request) -> web.Response:
        return await adapters_changed(engine.unload_adapter, *await fields(request, "lora_name"))
