"""Problem sets a library generates instead of a file holding them: ``reasoning_gym:NAME``.

    data:
      train_path: reasoning_gym:chain_sum?size=500&seed=1&max_digits=2
      eval_path: reasoning_gym:chain_sum?size=100&seed=2&max_digits=2

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (``pip install
'arbor[reasoning-gym]'``) generates each of its ~100 datasets item by item from a seed:
item ``i`` of ``create_dataset(NAME, seed=s, size=n, **options)`` is the same on every
machine. After the ``?`` come the dataset's own config fields (``size``, ``seed`` and the
dataset's options, each value read as YAML: ``operators=[+, -]``); ``seed`` defaults to 0
(reasoning-gym's default is a random one, which would change the set on every run).

Each item becomes a problem row: ``id`` ``NAME-SEED-INDEX``, ``prompt`` the question,
``answer`` the gold answer and ``reasoning_gym`` what regenerates it (``{"dataset", "config",
"index"}``). The reward (:mod:`arbor.rollout.adapters.reasoning_gym`) regenerates the item
from that, with its metadata, and scores with the dataset's own ``score_answer``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from typing import Any

import yaml

from arbor.dataset_files import DataError, Row

REASONING_GYM = "reasoning_gym:"


def is_source(path: str) -> bool:
    """Whether ``data.train_path`` / ``data.eval_path`` names a generated set, not a file."""
    return path.startswith(REASONING_GYM)


def source_rows(spec: str) -> Iterator[Row]:
    """``(where, row)`` for every item of the generated set ``spec`` (see the module doc)."""
    name, config = parse_spec(spec)
    dataset = _dataset(name, json.dumps(config, sort_keys=True), spec)
    for index in range(len(dataset)):
        item = dataset[index]
        yield f"{spec}[{index}]", {
            "id": f"{name}-{config['seed']}-{index}",
            "prompt": item["question"],
            "answer": item["answer"],
            "reasoning_gym": {"dataset": name, "config": config, "index": index},
        }


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``reasoning_gym:NAME?key=value&...`` as ``(NAME, config)``, ``seed`` defaulting to 0.

        parse_spec("reasoning_gym:chain_sum?size=8&operators=[+, -]")
        # ("chain_sum", {"size": 8, "operators": ["+", "-"], "seed": 0})
    """
    if not is_source(spec):
        raise DataError(f"{spec!r}: not a generated set (they start with {REASONING_GYM!r})")
    name, _, query = spec[len(REASONING_GYM):].partition("?")
    if not name:
        raise DataError(f"{spec!r}: no dataset name after {REASONING_GYM!r} (e.g. reasoning_gym:chain_sum)")
    config: dict[str, Any] = {}
    for pair in filter(None, query.split("&")):  # not URL-decoded: "+" stays a plus
        key, eq, text = pair.partition("=")
        if not key or not eq:
            raise DataError(f"{spec!r}: {pair!r} is not key=value")
        try:
            config[key] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise DataError(f"{spec!r}: the value of {key!r} is not YAML: {e}") from None
    config.setdefault("seed", 0)
    return name, config


def regenerate(problem: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(dataset, item)``: the reasoning-gym dataset and item a row of :func:`source_rows`
    came from, regenerated (``question``, ``answer``, ``metadata``) and checked against the
    row's question; ``dataset.score_answer(answer, item)`` scores an answer to it."""
    where = f"problem {problem.get('id')!r}"
    origin = problem.get("reasoning_gym")
    if not isinstance(origin, dict) or not {"dataset", "config", "index"} <= set(origin):
        raise DataError(f"{where}: no 'reasoning_gym' column ({{dataset, config, index}}): it does not "
                        f"come from a {REASONING_GYM}NAME set")
    name = origin["dataset"]
    dataset = _dataset(name, json.dumps(origin["config"], sort_keys=True), f"{REASONING_GYM}{name}")
    item = dataset[int(origin["index"])]
    if item["question"] != problem["prompt"]:
        raise DataError(f"{where}: reasoning-gym regenerates another question for {name} item "
                        f"{origin['index']} (its version differs from the one that made the set?)")
    return dataset, item


@functools.lru_cache(maxsize=16)
def _dataset(name: str, config_json: str, spec: str) -> Any:
    """``reasoning_gym.create_dataset(name, **config)``, once per process (scoring reuses it)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise DataError(f"{spec}: reasoning-gym is not installed (pip install 'arbor[reasoning-gym]'): {e}") from None
    if name not in DATASETS:
        raise DataError(f"{spec}: reasoning-gym has no dataset {name!r}; it has {', '.join(sorted(DATASETS))}")
    config = json.loads(config_json)
    fields = {f.name for f in dataclasses.fields(DATASETS[name][1])}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise DataError(f"{spec}: {name} has no option {', '.join(map(repr, unknown))}; its options: "
                        f"{', '.join(sorted(fields))}")
    try:
        return reasoning_gym.create_dataset(name, **config)
    except (AssertionError, TypeError, ValueError) as e:  # its configs validate with asserts
        raise DataError(f"{spec}: reasoning-gym refuses this {name} config {config}: {e}") from None
