"""The environment libraries the adapter tests run against (``pip install -e '.[envs]'``).

    textarena = require("textarena", "textarena")   # at the top of a test module

Without the package the module's tests skip on a developer's machine; under CI (``CI``
set) they fail: CI must test every adapter against its real package.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str, extra: str) -> ModuleType:
    """``import module``; skip the calling test module without it (fail under CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = f"{module} is not installed ({e}): pip install -e '.[{extra}]' (or '.[envs]' for every adapter)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the {extra} adapter against its real package, but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)
