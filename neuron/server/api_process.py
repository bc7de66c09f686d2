"""An API process (``[server] api_processes``): HTTP on the server's port (a socket of its own in
the port's SO_REUSEPORT group), the models in the engine core (``python -m
neuron.server.api_process --core ENDPOINT``; the core's token for the run and the config come
on stdin). It leaves when
the core says so, or when the core is gone."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import msgspec

from neuron.config import Config
from neuron.http_port import port_socket
from neuron.logs import configure_logging
from neuron.server.app import create_app
from neuron.server.core_client import CoreClient
from neuron.server.http_server import NeuronServer, planning_threads, uvicorn_config

log = logging.getLogger("neuron.server")
PARENT_WATCH_S = 0.5


class ApiServer(NeuronServer):
    """Signals are the core's to act on (it drains everyone, then tells us to leave)."""

    def handle_exit(self, sig: int, frame) -> None:
        pass


async def serve_api(cfg: Config, core: str, token: str) -> int:
    planning_threads()
    app = create_app(cfg, core=core, core_token=token)
    state = app.state.neuron
    client: CoreClient = state.engine_client
    server = ApiServer(uvicorn_config(app, cfg), state)
    client.on_closing = lambda: setattr(server, "should_exit", True)
    loop = asyncio.get_running_loop()
    if hasattr(signal, "SIGHUP"):
        loop.add_signal_handler(signal.SIGHUP, state.keys.reload)
    parent = os.getppid()

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(PARENT_WATCH_S)
        log.error("the engine core is gone; leaving")
        client.link.fail_all("the engine core is gone")
        server.should_exit = True

    watcher = loop.create_task(watch_parent())
    client.state = state  # the core's first Models frame says whether the models serve yet
    try:
        await client.first_state()  # only then into the port's group: the kernel hands us clients at once
        await server.serve(sockets=[port_socket(cfg, listening=True)])
    finally:
        watcher.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="neuron-api")
    parser.add_argument("--core", required=True)
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    token, _, config = sys.stdin.buffer.read().partition(b"\n")  # the core's token for this run, then the config
    cfg = msgspec.json.decode(config, type=Config)
    configure_logging(cfg.server.log_level, cfg.server.log_format, process=f"api-{args.index}")
    try:
        import uvloop
        return uvloop.run(serve_api(cfg, args.core, token.decode()))
    except ImportError:
        return asyncio.run(serve_api(cfg, args.core, token.decode()))


if __name__ == "__main__":
    sys.exit(main())
