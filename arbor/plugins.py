"""Resolve the extension points users name in configs (``module:attr``).

A spec is either a dotted module path (``rewards.math:boxed_accuracy``) or a Python
file (``rewards/math.py:boxed_accuracy``, ``/abs/path/agent.py:PythonTool``). Dotted
modules are imported with the search directories first on ``sys.path`` (the current
directory and the config file's directory and its parent), so the examples shipped in
the repository resolve when arbor runs from a checkout without being installed as
top-level packages (``agents`` and ``rewards`` would clash with other distributions).

Errors are :class:`~arbor.errors.ConfigError` naming the config key, never a bare
``ImportError`` from deep inside importlib.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arbor.errors import ConfigError


def default_search_dirs(config_path: str | os.PathLike[str] | None = None) -> list[str]:
    """Directories where relative specs are looked up: cwd, then the config's dir and its parent."""
    dirs = [os.getcwd()]
    if config_path is not None:
        config_dir = Path(config_path).resolve().parent
        dirs += [str(config_dir), str(config_dir.parent)]
    # Keep order, drop repeats.
    return list(dict.fromkeys(dirs))


def load_object(spec: str, key: str, search_dirs: Sequence[str] = ()) -> Any:
    """Import ``spec`` (``module:attr`` or ``path.py:attr``) and return the attribute.

    ``key`` is the config key the spec came from; it is named in every error.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(f"{key}: expected 'module:attr' or 'path/to/file.py:attr', got {spec!r}")
    module_name, attr = spec.split(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}: expected 'module:attr' or 'path/to/file.py:attr', got {spec!r}")
    dirs = list(search_dirs) or default_search_dirs()
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        module = _load_file(module_name, key, dirs)
    else:
        module = _import_dotted(module_name, key, dirs)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def _import_dotted(module_name: str, key: str, dirs: list[str]) -> Any:
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError(
                f"{key}: cannot import module {module_name!r} (searched sys.path and {dirs})"
            ) from None
        raise ConfigError(f"{key}: importing {module_name!r} failed: {e}") from e
    except Exception as e:  # a user module that fails at import is a config problem too
        raise ConfigError(f"{key}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e


def _load_file(module_path: str, key: str, dirs: list[str]) -> Any:
    candidates = [Path(module_path)] if os.path.isabs(module_path) else [Path(d) / module_path for d in dirs]
    for path in candidates:
        if path.is_file():
            break
    else:
        raise ConfigError(f"{key}: file {module_path!r} not found (looked in {dirs})")
    path = path.resolve()
    # One module object per file, so two specs naming the same file share its state.
    name = "arbor_user_" + "_".join(path.with_suffix("").parts[-3:]).replace("-", "_").replace(".", "_")
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{key}: loading {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module
