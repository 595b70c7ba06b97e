"""Errors a client caused, answered in its own API's shape with the field named."""

from __future__ import annotations

from typing import Optional

from aiohttp import web

# OpenAI's error types by status; Anthropic's are its own names for the same cases.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
}


class GatewayError(Exception):
    """A request the gateway refuses: `status`, a message for the client, the `param` at fault.

    Not a `UserError`: it also carries the engine's own failure (503), and it never leaves the
    gateway's handlers, which answer it to the agent's HTTP client.
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad(param: str, message: str, code: Optional[str] = None) -> GatewayError:
    """A 400 naming `param`."""
    return GatewayError(400, f"{param}: {message}", param, code)


def error_response(error: GatewayError, api: str) -> web.Response:
    """`error` as OpenAI's `{"error": {...}}` or Anthropic's `{"type": "error", "error": {...}}`."""
    if api == "anthropic":
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": error.message}}
    else:
        kind = _OPENAI_TYPES.get(error.status, "server_error")
        body = {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}
    return web.json_response(body, status=error.status)
