"""The rule for tests that need something beside arbor's Python packages (a real SGLang, the
bubblewrap sandbox, a network namespace, an imported GGUF, an optional extra): where it is
missing they skip and say why, but under CI (``CI`` set, as ``.ci/run`` does) they fail, since
``.ci/run`` installs every such thing and a skip there would hide a broken install.

    if shutil.which("bwrap") is None:
        unavailable("no bwrap on PATH: apt-get install bubblewrap")
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    """True when ``CI`` is set to anything but ``""``, ``0`` or ``false``."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def unavailable(why: str) -> NoReturn:
    """Skip the running test saying ``why``; under CI, fail it instead. At a module's top level
    (an import the whole module needs) it skips, or fails, the module's tests."""
    if under_ci():
        pytest.fail(f"CI must run this test, but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)
