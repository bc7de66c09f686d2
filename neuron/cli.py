"""``neuron``: ``serve`` starts the daemon; ``models``, ``load``, ``unload``, ``status`` and ``chat``
talk to a running one over HTTP. Flags override the TOML file, which overrides defaults."""

from __future__ import annotations

import argparse
import sys

from .ctl import chat, commands


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    s.add_argument("--config", help="TOML file (default: $NEURON_CONFIG, else built-in defaults)")
    s.add_argument("--host", help="address to bind (beyond loopback, an admin key is required)")
    s.add_argument("--port", type=int)
    s.add_argument("--model", help="model id, HF repo id, directory or .gguf path")
    s.add_argument("--tensor-parallel", type=int)
    s.add_argument("--device", choices=["cpu", "cuda", "auto"])
    s.add_argument("--insecure-admin", action="store_true",
                   help="serve beyond loopback without an admin key (anyone reaching the port may load "
                        "and unload models); same as [server] allow_insecure_admin = true")
    s.add_argument("--quantize", choices=["q8_0", "q4", "fp8", "none"],
                   help="quantize float (bf16/fp16/fp32) weights at load, on each rank, only its shard")
    s.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .serve import serve_main  # uvicorn and the server only for this command

    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neuron", description="Self-hosted LLM inference daemon")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    commands.add_parsers(sub)
    chat.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.run(args))


if __name__ == "__main__":
    main()
