"""Where the tests find a real SGLang: the interpreter in ``$ARBOR_SGLANG_PYTHON``.

``.ci/run`` builds it with scripts/sglang_cpu_env.sh and exports the variable. Unset on a
developer's machine, the real-SGLang tests skip; unset under CI, they fail (tests/ci_rule.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from ci_rule import unavailable

SGLANG_PYTHON_ENV = "ARBOR_SGLANG_PYTHON"
TINY_ARITH = Path(__file__).resolve().parents[1] / "models" / "tiny-arith"


def sglang_python() -> str:
    """The SGLang interpreter; skips (fails under CI) when ``$ARBOR_SGLANG_PYTHON`` is unset."""
    python = os.environ.get(SGLANG_PYTHON_ENV)
    if python:
        return python
    unavailable(f"${SGLANG_PYTHON_ENV} is unset: build the SGLang venv with scripts/sglang_cpu_env.sh DIR "
                f"and export {SGLANG_PYTHON_ENV}=DIR/bin/python")
