"""The environment libraries the adapter tests run against (``pip install -e '.[envs]'``).

    textarena = require("textarena", "textarena")   # at the top of a test module

Without the package the module's tests skip on a developer's machine; under CI they fail
(tests/ci_rule.py): CI must test every adapter against its real package.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ci_rule import unavailable


def require(module: str, extra: str) -> ModuleType:
    """``import module``; skip the calling test module without it (fail under CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        unavailable(f"the {extra} adapter's package {module} is not installed ({e}): pip install -e '.[{extra}]' "
                    "(or '.[envs]' for every adapter)")
