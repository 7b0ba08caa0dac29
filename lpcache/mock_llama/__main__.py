"""``python -m lpcache.mock_llama PORT MODEL [options]``: serve a stand-in llama-server.

``python -m lpcache.mock_llama PORT --router --models a,b [--models-max N] [--no-models-autoload]``
serves a router instead, one child per model (MODEL is then unused).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import orjson
import uvicorn

from lpcache.mock_llama.config import MockConfig
from lpcache.mock_llama.server import create_app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lpcache.mock_llama", description=__doc__)
    parser.add_argument("port", type=int, help="port to listen on")
    parser.add_argument("model", nargs="?", default="mock-model",
                        help="model name reported by /v1/models and /props (default mock-model; unused with --router)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--slots", type=int, default=2, help="number of slots (default 2)")
    parser.add_argument(
        "--slot-save-path", default=None, help="existing directory for slot files; without it POST /slots/* is 501"
    )
    parser.add_argument("--n-ctx", type=int, default=8192, help="context per slot, in tokens (default 8192)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="simulated prefill time per token")
    parser.add_argument("--gen-ms-per-token", type=float, default=0.0, help="simulated time per generated token")
    parser.add_argument("--kv-bytes-per-token", type=int, default=0,
                        help="slot files padded to this many bytes per token, as a real model's KV cache (default 0)")
    parser.add_argument("--max-tokens-default", type=int, default=16, help="answer length without max_tokens")
    parser.add_argument("--api-key", default=None, help="require this key (comma-separated list allowed)")
    parser.add_argument("--swa", action="store_true",
                        help="act as a sliding-window model without --swa-full: restored slots are not reused")
    parser.add_argument("--fim", action=argparse.BooleanOptionalAction, default=True,
                        help="the model has fill-in-the-middle tokens; --no-fim answers /infill with 501 (default on)")
    parser.add_argument("--faults", default=None, help='faults armed at start, as JSON: {"drop": 1, ...}')
    parser.add_argument("--router", action="store_true",
                        help="router mode, as llama-server without -m: requests name one of --models")
    parser.add_argument("--models", default="", help="router mode: comma-separated model names")
    parser.add_argument("--models-max", type=int, default=4,
                        help="router mode: most models loaded at once, 0 = unlimited (default 4)")
    parser.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                        help="router mode: load a requested model unless ?autoload=false (default on)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return parser


def config_from(args: argparse.Namespace) -> MockConfig:
    """The config the flags describe; ValueError names what is wrong."""
    try:
        faults = orjson.loads(args.faults) if args.faults else {}
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--faults is not valid JSON: {exc}") from exc
    if not isinstance(faults, dict):
        raise ValueError("--faults must be a JSON object")
    return MockConfig(
        port=args.port,
        model=args.model,
        host=args.host,
        slots=args.slots,
        slot_save_path=args.slot_save_path,
        n_ctx=args.n_ctx,
        prefill_ms_per_token=args.prefill_ms_per_token,
        gen_ms_per_token=args.gen_ms_per_token,
        kv_bytes_per_token=args.kv_bytes_per_token,
        max_tokens_default=args.max_tokens_default,
        api_key=args.api_key,
        swa=args.swa,
        fim=args.fim,
        faults=faults,
        router=args.router,
        models=tuple(name.strip() for name in args.models.split(",") if name.strip()),
        models_max=args.models_max,
        models_autoload=args.models_autoload,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        app = create_app(config_from(args))  # bad faults fail here, not at the first request
    except ValueError as exc:
        parser.error(str(exc))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
