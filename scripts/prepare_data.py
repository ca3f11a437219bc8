"""Turn a local copy of a common math RL set into arbor's columns: ``id``, ``prompt``, ``answer``.

    python scripts/prepare_data.py ~/MATH/train.parquet --out data/math/train.jsonl
    python scripts/prepare_data.py ~/gsm8k/main --out data/gsm8k/train.jsonl      # an HF dataset folder
    python scripts/prepare_data.py --hub HuggingFaceH4/MATH-500 --split test --out data/math/test500.jsonl

The input is a ``.jsonl``, ``.json``, ``.parquet`` or ``.arrow`` file, a ``save_to_disk``
folder or a folder of shards (:mod:`arbor.dataset_files`); with ``--hub NAME`` it is
``datasets.load_dataset(NAME, --config, split=--split)``, which needs network access.
The output is ``.jsonl`` or ``.parquet`` (by its suffix), ready for ``data.train_path`` with
the default ``data.*_key`` settings. Layouts (``--layout``, detected from the columns by default):

- ``math``: MATH, MATH-500, DeepScaleR's raw rows — ``problem`` and ``answer`` or
  ``solution`` (or both). The answer is the ``answer`` column when present, else the last ``\\boxed{}``
  of the solution (``arbor.rollout.answers.last_boxed``).
- ``gsm8k``: ``question``, ``answer`` = worked solution ending ``#### 1,234``. The answer is
  the part after ``####`` without thousands separators; the worked text becomes ``solution``.
- ``verl``: verl's preprocessed rows as DeepScaleR and DAPO-Math-17k ship them —
  ``prompt`` = chat messages, ``reward_model: {style, ground_truth}``, ``extra_info:
  {split, index}``. The messages stay the prompt as they are (with any instruction the set
  wrote into them: check that it asks for the format your reward function reads).

Every other column is kept (reward functions receive it). The id is the row's ``id`` or
``unique_id``, verl's ``extra_info.index``, else ``<input name>-<row>``. Rows with no
answer to extract are skipped and listed; duplicate ids are an error. Ends with
``wrote N problems to OUT``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from arbor.dataset_files import DataError, read_rows  # noqa: E402
from arbor.rollout.answers import last_boxed  # noqa: E402

Problem = dict[str, Any]
GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def math_problem(row: dict[str, Any]) -> Problem | None:
    answer = row.get("answer")
    if answer is None:
        answer = last_boxed(row.get("solution") or "")
    rest = {k: v for k, v in row.items() if k not in ("problem", "answer")}
    return None if answer is None or not str(answer).strip() else {"prompt": row["problem"], "answer": str(answer).strip(), **rest}


def gsm8k_problem(row: dict[str, Any]) -> Problem | None:
    final = GSM8K_FINAL.search(row["answer"])
    if final is None:
        return None
    answer = final.group(1).replace(",", "")  # "1,234" -> "1234": the model is not asked for separators
    rest = {k: v for k, v in row.items() if k not in ("question", "answer")}
    return {"prompt": row["question"], "answer": answer, "solution": row["answer"], **rest}


def verl_problem(row: dict[str, Any]) -> Problem | None:
    answer = (row.get("reward_model") or {}).get("ground_truth")
    if answer is None or not str(answer).strip():
        return None
    rest = {k: v for k, v in row.items() if k not in ("prompt", "reward_model")}
    return {"prompt": row["prompt"], "answer": str(answer).strip(), **rest}


LAYOUTS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], Problem | None]]] = {
    # layout: (columns it needs, converter)
    "verl": (("prompt", "reward_model"), verl_problem),
    "math": (("problem",), math_problem),  # + answer or solution
    "gsm8k": (("question", "answer"), gsm8k_problem),
}


def detect_layout(row: dict[str, Any], where: str) -> str:
    for name, (needed, _) in LAYOUTS.items():
        if all(key in row for key in needed):
            return name
    raise DataError(
        f"{where}: no known layout in the columns {sorted(row)}; expected "
        + "; ".join(f"{name}: {', '.join(needed)}" for name, (needed, _) in LAYOUTS.items())
    )


def problem_id(row: dict[str, Any], stem: str, index: int) -> str:
    for key in ("id", "unique_id"):
        if row.get(key) is not None:
            return str(row[key])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return f"{stem}-{index}"


def convert(rows: Iterator[tuple[str, Any]], layout: str, stem: str) -> tuple[list[Problem], list[str]]:
    """``(problems, skipped)``: arbor rows, and where the rows without an answer were."""
    problems: list[Problem] = []
    skipped: list[str] = []
    seen: dict[str, str] = {}
    for index, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
        row_layout = detect_layout(row, where) if layout == "auto" else layout
        needed, to_problem = LAYOUTS[row_layout]
        missing = [key for key in needed if key not in row]
        if missing:
            raise DataError(f"{where}: the {row_layout} layout needs the columns {', '.join(missing)}; columns: {sorted(row)}")
        problem = to_problem(row)
        if problem is None:
            skipped.append(where)
            continue
        pid = problem_id(row, stem, index)
        if pid in seen:
            raise DataError(f"{where}: duplicate problem id {pid!r} (first at {seen[pid]})")
        seen[pid] = where
        problems.append({"id": pid, **{k: v for k, v in problem.items() if k != "id"}})
    return problems, skipped


def hub_rows(name: str, config: str | None, split: str) -> Iterator[tuple[str, Any]]:
    """Rows of ``datasets.load_dataset(name, config, split=split)`` (downloads: needs network)."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # no network, no such set or split: many types, one message
        raise DataError(f"--hub {name} (split {split!r}): cannot load it: {type(e).__name__}: {e}") from None
    for i, row in enumerate(dataset):
        yield f"{name}[{split}][{i}]", row


def write(problems: list[Problem], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in problems))
    elif out.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(problems).to_parquet(str(out))
    else:
        raise DataError(f"--out {out}: write .jsonl or .parquet")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", nargs="?", help="a .jsonl/.json/.parquet/.arrow file or a dataset folder")
    parser.add_argument("--hub", metavar="NAME", help="load NAME with datasets.load_dataset instead (network)")
    parser.add_argument("--config", default=None, help="--hub: the dataset's configuration (gsm8k: main)")
    parser.add_argument("--split", default="train", help="--hub: the split to convert (default: train)")
    parser.add_argument("--layout", choices=["auto", *LAYOUTS], default="auto")
    parser.add_argument("--out", required=True, type=Path, help="the .jsonl or .parquet file to write")
    args = parser.parse_args(argv)
    if (args.input is None) == (args.hub is None):
        parser.error("give an input path or --hub NAME (one of them)")
    try:
        if args.hub:
            rows, stem = hub_rows(args.hub, args.config, args.split), f"{args.hub.split('/')[-1]}-{args.split}"
        else:
            path = Path(args.input)
            if not path.exists():
                raise DataError(f"{path}: no such file or directory")
            rows, stem = read_rows(path), path.stem
        problems, skipped = convert(rows, args.layout, stem)
        if not problems:
            raise DataError(f"{args.hub or args.input}: no problem with an answer in it")
        write(problems, args.out)
    except DataError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    if skipped:
        print(f"prepare_data: skipped {len(skipped)} rows with no answer to extract: "
              + ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""), file=sys.stderr)
    print(f"wrote {len(problems)} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
