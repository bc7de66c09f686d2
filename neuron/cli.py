"""``neuron serve``: start the daemon. Flags override the TOML file, which overrides defaults."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import uvicorn

from .config import Config, ConfigError, load_config, validate
from .server.app import create_app

log = logging.getLogger("neuron")


class NeuronServer(uvicorn.Server):
    """uvicorn, with SIGTERM meaning: stop admitting (503), drain in-flight requests up to the
    drain deadline, then shut down. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, app_state) -> None:
        super().__init__(config)
        self.app_state = app_state
        self.exit_code = 0
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain is not None:
            super().handle_exit(sig, frame)
            return
        self.app_state.draining = True
        self.app_state.registry.stop_admission()
        loop = asyncio.get_event_loop()
        self._drain = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        timeout = self.app_state.cfg.server.drain_timeout_s
        log.info("draining in-flight requests (up to %.0fs)", timeout)
        if not await self.app_state.registry.drain(timeout):
            log.warning("drain deadline passed; aborting what is left")
        self.should_exit = True

    def fail_startup(self, message: str) -> None:
        self.exit_code = 1
        self.should_exit = True


def apply_flags(cfg: Config, args: argparse.Namespace) -> Config:
    if args.host:
        cfg.server.host = args.host
    if args.port is not None:
        cfg.server.port = args.port
    if args.model:
        first = cfg.models[0] if cfg.models else None
        from .config import ModelEntry
        entry = ModelEntry(model=args.model)
        if first is not None:
            entry.max_model_len, entry.max_slots, entry.dtype = first.max_model_len, first.max_slots, first.dtype
            entry.device, entry.tensor_parallel = first.device, first.tensor_parallel
            entry.quantize = first.quantize
        cfg.models = [entry]
    for entry in cfg.models:
        if args.tensor_parallel is not None:
            entry.tensor_parallel = args.tensor_parallel
        if args.device:
            entry.device = args.device
        if args.quantize is not None:
            entry.quantize = "" if args.quantize == "none" else args.quantize
    validate(cfg)
    return cfg


async def serve(cfg: Config) -> int:
    app = create_app(cfg)
    state = app.state.neuron
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
                            lifespan="on", timeout_graceful_shutdown=5, access_log=False)
    server = NeuronServer(config, state)
    state.on_startup_failure = server.fail_startup
    await server.serve()
    return server.exit_code


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="neuron", description="Self-hosted LLM inference daemon")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    s.add_argument("--config", help="TOML file (default: $NEURON_CONFIG, else built-in defaults)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--model", help="model id, HF repo id, directory or .gguf path")
    s.add_argument("--tensor-parallel", type=int)
    s.add_argument("--device", choices=["cpu", "cuda", "auto"])
    s.add_argument("--quantize", choices=["q8_0", "q4", "none"],
                   help="quantize float (bf16/fp16/fp32) weights at load, on each rank, only its shard"),
    args = ap.parse_args(argv)
    try:
        cfg = apply_flags(load_config(args.config or os.environ.get("NEURON_CONFIG")), args)
    except ConfigError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=cfg.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s leader %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        code = uvloop.run(serve(cfg))
    except ImportError:
        code = asyncio.run(serve(cfg))
    sys.exit(code)


if __name__ == "__main__":
    main()
