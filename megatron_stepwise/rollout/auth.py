"""API keys for engine HTTP endpoints, SGLang's convention: `Authorization: Bearer <key>`.

The key comes from the environment (`MEGATRON_STEPWISE_API_KEY`), never from a YAML file or a log
line. With a key set, the embedded engine server (`megatron-stepwise serve`) answers 401 to every
request without it except health checks, launched SGLang servers get `--api-key`, and the client
sends it. Without one, servers bind to loopback only unless explicitly allowed otherwise.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from typing import Optional

API_KEY_ENV = "MEGATRON_STEPWISE_API_KEY"


def api_key_from_env() -> Optional[str]:
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def bearer_matches(header: Optional[str], api_key: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <key>` header."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
