"""API keys for engine HTTP endpoints, SGLang's convention: `Authorization: Bearer <key>`.

The key comes from the environment (`MEGATRON_STEPWISE_API_KEY`), never from a YAML file or a log
line. With a key set, the embedded engine server (`megatron-stepwise serve`) answers 401 to every
request without it except health checks, launched SGLang servers get `--api-key`, and the client
sends it. Without one, servers bind to loopback only unless explicitly allowed otherwise.
aiohttp logs a request it cannot parse with the offending header line: `redact_bearer_tokens`
removes any bearer token from those records, so a malformed header never puts the key in a log.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import traceback
from typing import Optional

API_KEY_ENV = "MEGATRON_STEPWISE_API_KEY"


def api_key_from_env() -> Optional[str]:
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def bearer_matches(header: Optional[str], api_key: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <key>` header."""
    scheme, _, token = (header or "").partition(" ")
    try:
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())
    except UnicodeEncodeError:  # undecodable bytes in the header: a wrong key (401), not a 500
        return False


_BEARER = re.compile(r"(bearer\s+)[^\s'\"\\]+", re.IGNORECASE)


class _RedactBearer(logging.Filter):
    """Rewrites a record (message and traceback) with every bearer token replaced by <redacted>."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        redacted = _BEARER.sub(r"\1<redacted>", text)
        if redacted != text:
            record.msg, record.args, record.exc_info, record.exc_text = redacted, (), None, None
        return True


_REDACT = _RedactBearer()


def redact_bearer_tokens(logger_name: str = "aiohttp.server") -> None:
    """Keep bearer tokens out of `logger_name`'s records (idempotent)."""
    logger = logging.getLogger(logger_name)
    if _REDACT not in logger.filters:
        logger.addFilter(_REDACT)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
