"""Bearer keys for engine endpoints: SGLang 0.5.23's rules (``srt/utils/auth.py``), for `arbor serve`.

    decide("POST", "/flush_cache", "Bearer k", api_key="k", admin_api_key="k", level=ADMIN_OPTIONAL)
    -> None (allowed); 401 without or with a wrong token; 403 for an ADMIN_FORCE endpoint
    on a server that has no admin key.

The rules, as SGLang applies them to every request:
- ``OPTIONS`` and the probes (paths starting ``/health``, ``/ready``, ``/metrics``) are open;
- ``NORMAL`` endpoints (``/generate``, ``/model_info``, ...) need ``api_key`` when one is set
  (an admin key alone leaves them open);
- ``ADMIN_OPTIONAL`` endpoints (weights, cache, memory) need ``admin_api_key`` when one is
  set (``api_key`` is then *not* accepted), else ``api_key`` when set, else nothing;
- ``ADMIN_FORCE`` endpoints need ``admin_api_key`` and answer 403 on a server without one.
  SGLang 0.5.23 marks no endpoint so (its weight endpoints are ``ADMIN_OPTIONAL``), and
  neither does `arbor serve`: a keyless server would refuse them.

A run gives its engines one key for both roles (``--api-key K --admin-api-key K``), so the
client sends one ``Authorization: Bearer K`` everywhere. Keys travel in the environment
(:data:`API_KEY_ENV`, :data:`ADMIN_API_KEY_ENV`), never on a command line.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import os
import secrets
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:  # annotations only: aiohttp's names for a middleware and a handler
    from aiohttp.typedefs import Handler, Middleware

API_KEY_ENV = "ARBOR_ENGINE_API_KEY"  # the key engines require and clients send
ADMIN_API_KEY_ENV = "ARBOR_ENGINE_ADMIN_API_KEY"  # `arbor serve` only: a separate admin key
PROBE_PREFIXES = ("/health", "/ready", "/metrics")  # open, so probes need no secret


class Level(enum.Enum):
    """How much key an endpoint needs (SGLang's ``AuthLevel``)."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


def _bearer_matches(authorization: str | None, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    # Bytes, not str: compare_digest refuses non-ASCII str (a 500 instead of a 401).
    return hmac.compare_digest(token.encode(), key.encode())


def decide(
    method: str,
    path: str,
    authorization: str | None,
    *,
    api_key: str | None,
    admin_api_key: str | None,
    level: Level,
) -> int | None:
    """None when the request may pass, else the status to refuse it with (401 or 403)."""
    if method == "OPTIONS" or path.startswith(PROBE_PREFIXES):
        return None
    if level is Level.ADMIN_FORCE:
        if not admin_api_key:
            return 403  # no key can open it on this server
        required: str | None = admin_api_key
    elif level is Level.ADMIN_OPTIONAL:
        required = admin_api_key or api_key
    else:
        required = api_key
    if not required:
        return None
    return None if _bearer_matches(authorization, required) else 401


def middleware(
    api_key: str | None, admin_api_key: str | None, levels: dict[str, Level]
) -> Middleware:
    """aiohttp middleware applying :func:`decide`; ``levels`` maps paths to their level
    (others are ``NORMAL``, unknown paths included: a wrong key learns nothing, as in SGLang)."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = decide(
            request.method, request.path, request.headers.get("Authorization"),
            api_key=api_key, admin_api_key=admin_api_key,
            level=levels.get(request.path, Level.NORMAL),
        )
        if status is not None:  # SGLang's body for the same refusal
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        return await handler(request)

    return check_key


def run_api_key(configured: str | None, *, launch: bool) -> str | None:
    """A run's engine key: ``engine.api_key``, else ``$ARBOR_ENGINE_API_KEY``, else (for
    engines the run starts itself, ``launch``) a fresh random one; None for external engines
    given no key (servers the user started without one)."""
    key = configured or os.environ.get(API_KEY_ENV)
    if not key and launch:
        # 256 bits in hex: a URL-safe key may start with "-", which SGLang's argument parser
        # (fed from its --config file) takes for a flag: "--admin-api-key: expected one argument".
        key = secrets.token_hex(32)
    return key or None


def unprotected_warning(host: str, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The warning `arbor serve` prints when anyone on the network could drive it, else None."""
    if api_key or admin_api_key or _is_loopback(host):
        return None
    return (
        f"arbor serve: WARNING: listening on {host} without a key: anyone who can reach this "
        f"address can load weights into the engine, flush or pause it. Set {API_KEY_ENV} "
        "(and optionally " + ADMIN_API_KEY_ENV + ") in the server's environment, or bind 127.0.0.1."
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
