"""`serve`: the embedded CPU engine behind SGLang's native HTTP API (rollout/engines/embedded/server.py).

megatron-stepwise serve --model-config tiny_word --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
import sys
from typing import Any

from megatron_stepwise.cli.arg_types import int_at_least
from megatron_stepwise.errors import UserError
from megatron_stepwise.rollout.engines.auth import API_KEY_ENV, api_key_from_env
from megatron_stepwise.rollout.engines.embedded.engine import LocalEngine
from megatron_stepwise.rollout.engines.embedded.server import start_server


def build_engine_from_args(args: argparse.Namespace) -> LocalEngine:
    from megatron_stepwise.hf.tokenizers import TOKENIZER_NAMES, load_tokenizer
    from megatron_stepwise.rollout.engines.embedded.hf_model import tiny_qwen2_config

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    model_config: Any = args.model_config
    if model_config in TOKENIZER_NAMES:  # a tiny model sized for a shipped tokenizer
        tokenizer = tokenizer or load_tokenizer(model_config)
        model_config = tiny_qwen2_config(len(tokenizer))
    return LocalEngine(
        model_config,
        weights=args.weights,
        tokenizer=tokenizer,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        torch_threads=args.torch_threads,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )


class BindError(UserError):
    """The server could not listen where it was asked to (the message names host, port and why)."""


def bind_problem(host: str, port: int, error: OSError) -> str:
    reason = error.strerror or str(error)
    if error.errno == errno.EADDRINUSE:
        hint = "another process listens there: choose another --port"
    elif error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        hint = "--host must be an address of this machine (or 0.0.0.0 for all of them)"
    else:
        hint = "check --host and --port"
    return f"cannot serve on {host}:{port}: {reason}; {hint}"


def _port(text: str) -> int:
    """--port: 0 (any free port) to 65535, or an argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535)")
    return value


_positive, _not_negative = int_at_least(1), int_at_least(0)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the embedded CPU engine over SGLang's HTTP API")
    p.add_argument(
        "--model-config",
        required=True,
        help="HF config.json / model dir, or a shipped tokenizer's name (tiny_word, tiny_char, "
        "tiny_bpe) for a tiny model and tokenizer",
    )
    p.add_argument("--weights", default=None, help="directory of HF-named safetensors to load")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or shipped name (for stop strings and text)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"interface to bind; beyond loopback the server needs ${API_KEY_ENV} (Bearer key)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help=f"serve beyond loopback without ${API_KEY_ENV} (only on a network you trust)",
    )
    p.add_argument("--port", type=_port, default=30000, help="port to listen on (0 = any free port)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument(
        "--prefix-cache-tokens",
        type=_not_negative,
        default=32768,
        help="token budget of the prefix cache (finished requests' KV; 0 turns it off)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=None,
        help="refuse larger request bodies with 413 (default: max-batch-size prompts filling the "
        "context window, 32 bytes a token, + 1 MiB; weight uploads have their own limit)",
    )
    p.add_argument(
        "--max-tokens-in-flight",
        type=_not_negative,
        default=None,
        help="admission budget: tokens (prompt + max_new_tokens) admitted and not finished, shared "
        "fairly between clients (X-Client-Id header, else address); past it /generate answers 503 "
        "with Retry-After (default: two full batches of 2048-token requests; 0: admit everything)",
    )
    p.set_defaults(func=_serve_main)


def _serve_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    async def run() -> None:
        engine = build_engine_from_args(args)
        try:
            runner, port = await start_server(
                engine,
                args.host,
                args.port,
                api_key=api_key_from_env(),
                allow_unauthenticated=args.allow_unauthenticated,
                max_request_bytes=args.max_request_bytes,
                max_tokens_in_flight=args.max_tokens_in_flight,
            )
        except OSError as e:  # the port is taken, or the host is not an address of this machine
            await engine.close()
            raise BindError(bind_problem(args.host, args.port, e)) from None
        print(f"serving the embedded engine on http://{args.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            await engine.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # a refused configuration (e.g. exposed without a key): no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
