"""``neuron serve``: the daemon's startup. Flags over the TOML file over defaults; refuses to
expose the admin routes beyond loopback without a key unless told to; SIGTERM drains."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import sys

from .config import Config, ConfigError, ModelEntry, load_config, validate
from .core.api_processes import api_process_count
from .devices import gpu_count
from . import rank_forks
from .logs import configure_logging
from .server.app import create_app
from .server.http_server import NeuronServer, planning_threads, uvicorn_config

log = logging.getLogger("neuron")


def apply_flags(cfg: Config, args: argparse.Namespace) -> Config:
    if args.host:
        cfg.server.host = args.host
    if args.port is not None:
        cfg.server.port = args.port
    if args.insecure_admin:
        cfg.server.allow_insecure_admin = True
    if args.model:  # the configured model's settings, for another model
        first = cfg.models[0] if cfg.models else ModelEntry()
        cfg.models = [dataclasses.replace(first, model=args.model, id="")]
    for entry in cfg.models:
        if args.tensor_parallel is not None:
            entry.tensor_parallel = args.tensor_parallel
        if getattr(args, "pipeline_parallel", None) is not None:
            entry.pipeline_parallel = args.pipeline_parallel
        if args.device:
            entry.device = args.device
        if getattr(args, "quantize", None) is not None:
            entry.quantize = "" if args.quantize == "none" else args.quantize
    for flag, name in (("nnodes", "nnodes"), ("node_rank", "node_rank"), ("master_addr", "master_addr"),
                       ("master_port", "master_port"), ("group_key", "group_key")):
        if getattr(args, flag, None) is not None:
            setattr(cfg.cluster, name, getattr(args, flag))
    validate(cfg)
    return cfg


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name we cannot vouch for, or "" (every interface)


def admin_exposure(cfg: Config) -> str | None:
    """Why this bind must be refused, or None. Beyond loopback, an open /models/load lets anyone
    who reaches the port load and unload models."""
    server = cfg.server
    if is_loopback(server.host) or server.admin_api_key or server.allow_insecure_admin:
        return None
    return (f"refusing to serve on {server.host!r} without an admin key: anyone who can reach port "
            f"{server.port} could load and unload models. Set [server] admin_api_key (or "
            f"NEURON_SERVER__ADMIN_API_KEY), bind to 127.0.0.1, or accept the risk with --insecure-admin "
            f"([server] allow_insecure_admin = true).")


def _head_key_refusal(cfg: Config) -> str | None:
    """Why the head of a group cannot use its key file, or None."""
    if cfg.cluster.nnodes < 2:
        return None
    from .cluster.keys import GroupKeyError, read_key

    try:
        read_key(cfg.cluster.group_key, head=True)
    except GroupKeyError as exc:
        return str(exc)
    return None


def _keys_file_refusal(cfg: Config) -> str | None:
    """Why the keys file cannot be used, or None."""
    if not cfg.server.api_keys_file:
        return None
    from .server.keys import KeysFileError, read_keys_file

    try:
        read_keys_file(cfg.server.api_keys_file)
    except KeysFileError as exc:
        return str(exc)
    return None


async def serve(cfg: Config) -> int:
    if not gpu_count():  # CPU ranks: torch imported for them while the daemon starts
        rank_forks.warm()
    if api_process_count(cfg.server):
        from .core.main import serve_core

        return await serve_core(cfg)
    planning_threads()
    app = create_app(cfg)
    state = app.state.neuron
    server = NeuronServer(uvicorn_config(app, cfg), state)
    state.on_startup_failure = server.fail_startup
    if hasattr(signal, "SIGHUP"):  # the operator edited the keys file
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, state.keys.reload)
    await server.serve()
    return server.exit_code


def serve_main(args: argparse.Namespace) -> int:
    try:
        cfg = apply_flags(load_config(args.config or os.environ.get("NEURON_CONFIG")), args)
    except ConfigError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        return 2
    if cfg.cluster.node_rank > 0:  # a node of a group: no HTTP API, only this host's ranks
        from .cluster.node import run_node

        configure_logging(cfg.server.log_level, cfg.server.log_format)
        return run_node(cfg)
    refused = admin_exposure(cfg) or _head_key_refusal(cfg) or _keys_file_refusal(cfg)
    if refused is not None:
        print(f"neuron: {refused}", file=sys.stderr)
        return 2
    configure_logging(cfg.server.log_level, cfg.server.log_format)
    if not is_loopback(cfg.server.host) and not cfg.server.admin_api_key:
        log.warning("serving on %r with no admin key: anyone who can reach port %d can load and unload "
                    "models (allowed by --insecure-admin / [server] allow_insecure_admin)",
                    cfg.server.host, cfg.server.port)
    try:
        import uvloop
        return uvloop.run(serve(cfg))
    except ImportError:
        return asyncio.run(serve(cfg))
