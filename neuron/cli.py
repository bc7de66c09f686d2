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
    s.add_argument("--pipeline-parallel", type=int, help="split the layers into this many stages (each "
                   "--tensor-parallel ranks); across hosts, a stage per host (docs/multihost.md)")
    s.add_argument("--device", choices=["cpu", "cuda", "auto"])
    s.add_argument("--insecure-admin", action="store_true",
                   help="serve beyond loopback without an admin key (anyone reaching the port may load "
                        "and unload models); same as [server] allow_insecure_admin = true")
    s.add_argument("--quantize", choices=["q8_0", "q4", "fp8", "none"],
                   help="quantize float (bf16/fp16/fp32) weights at load, on each rank, only its shard")
    c = s.add_argument_group("across hosts", "one model over several nodes (docs/multihost.md); the same "
                             "settings come from NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and [cluster]")
    c.add_argument("--nnodes", type=int, help="how many nodes serve the model (tensor_parallel / nnodes ranks each)")
    c.add_argument("--node-rank", type=int, help="this node: 0 is the head (HTTP API); others only run ranks")
    c.add_argument("--master-addr", help="the head's address on the nodes' private network")
    c.add_argument("--master-port", type=int, help="the head's port for the nodes (default 29500)")
    c.add_argument("--group-key", help="the group key file (`neuron keygen FILE`: FILE on the head, FILE.node "
                                      "on the other nodes)")
    s.set_defaults(run=_serve)


def _keygen_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keygen", help="write a new group key for serving one model across hosts")
    k.add_argument("file", help="where to write the head's key; the nodes' goes beside it as FILE.node "
                                "(mode 0600; existing files are never overwritten)")
    k.set_defaults(run=_keygen)


def _keygen(args: argparse.Namespace) -> int:
    from .cluster.keys import write_key

    try:
        head, node = write_key(args.file)
    except FileExistsError as exc:
        print(f"neuron: {exc.args[0] if exc.args else args.file} exists; not overwritten", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"neuron: cannot write {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote the group key {head} for the head and {node} for the other nodes (mode 0600): pass each "
          "host its file as --group-key; the nodes' file cannot serve as the head")
    return 0


def _keys_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="named API keys ([server] api_keys_file)")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    add = ksub.add_parser("add", help="make a key for NAME: its hash is appended to the keys file, the key "
                                      "is printed once")
    add.add_argument("name", help="the key's name: the principal its requests are counted and shared under")
    add.add_argument("--file", help="the keys file (default: [server] api_keys_file of --config / $NEURON_CONFIG)")
    add.add_argument("--config", help="TOML file whose [server] api_keys_file to use")
    add.add_argument("--max-running", type=int, help="its running requests per model at most")
    add.add_argument("--max-waiting", type=int, help="its waiting requests per model at most (beyond: 429)")
    add.add_argument("--weight", type=float, help="its share against the other keys' (default 1)")
    add.add_argument("--gateway", action="store_true", help="a gateway's key: its requests may name their "
                     "account in [server] principal_header")
    add.set_defaults(run=_keys_add)


def _keys_add(args: argparse.Namespace) -> int:
    import os

    from .config import ConfigError, load_config
    from .server.keys import KeysFileError, add_key

    path = args.file
    if not path:
        try:
            path = load_config(args.config or os.environ.get("NEURON_CONFIG")).server.api_keys_file
        except ConfigError as exc:
            print(f"neuron: {exc}", file=sys.stderr)
            return 2
    if not path:
        print("neuron: no keys file: pass --file, or set [server] api_keys_file", file=sys.stderr)
        return 2
    try:
        key = add_key(path, args.name, args.max_running, args.max_waiting, args.weight, args.gateway)
    except (KeysFileError, OSError) as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        return 1
    print(key)
    print(f"added {args.name!r} to {path}; send SIGHUP to a running daemon to read it (the key is shown only "
          "this once)", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from . import rank_forks
    from .devices import gpu_count

    if not gpu_count():  # CPU ranks: torch imported for them while the daemon starts
        rank_forks.prestart()
    from .serve import serve_main  # uvicorn and the server only for this command

    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neuron", description="Self-hosted LLM inference daemon")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    _keygen_parser(sub)
    _keys_parser(sub)
    commands.add_parsers(sub)
    chat.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.run(args))


if __name__ == "__main__":
    main()
