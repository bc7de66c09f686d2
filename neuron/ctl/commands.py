"""``neuron models``, ``load``, ``unload`` and ``status``: the admin routes from a terminal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .client import CtlError, Daemon, add_connection_flags

COLUMNS = [("ID", "id"), ("STATUS", "status"), ("TP", "tensor_parallel"), ("DEVICES", "devices"),
           ("DTYPE", "dtype"), ("MAX_LEN", "max_model_len"), ("RUNNING", "running"), ("WAITING", "waiting")]


def table(models: list[dict[str, Any]]) -> str:
    def cell(model: dict[str, Any], key: str) -> str:
        value = model.get(key)
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    rows = [[h for h, _ in COLUMNS]] + [[cell(m, k) for _, k in COLUMNS] for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _print(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data, indent=2) if as_json else text)


def models(args: argparse.Namespace, daemon: Daemon) -> int:
    _, data = daemon.call("GET", "/models", admin=True)
    _print(data, args.json, table(data["models"]) if data["models"] else "no models")
    return 0


def load(args: argparse.Namespace, daemon: Daemon) -> int:
    body: dict[str, Any] = {"model": args.model}
    for key in ("id", "tensor_parallel", "device", "dtype", "max_model_len", "max_slots"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.devices:
        body["devices"] = [int(d) for d in args.devices.split(",")]
    if args.alias:
        body["aliases"] = args.alias
    _, data = daemon.call("POST", "/models/load", admin=True, body=body, timeout=None)
    _print(data, args.json, f"loaded {data['id']} in {data['load_seconds']}s on {','.join(data['devices'])} "
                            f"({data['dtype']}, max_model_len {data['max_model_len']})")
    return 0


def unload(args: argparse.Namespace, daemon: Daemon) -> int:
    _, data = daemon.call("POST", "/models/unload", admin=True, body={"model": args.id}, timeout=None)
    _print(data, args.json, f"unloaded {data['model']}")
    return 0


USAGE = {"neuron:principal_requests": "requests", "neuron:principal_prompt_tokens": "prompt_tokens",
         "neuron:principal_cached_tokens": "cached_tokens", "neuron:principal_generation_tokens": "completion_tokens"}


def usage(metrics: str) -> dict[str, dict[str, int]]:
    """Per principal, from the ``/metrics`` text: requests, tokens, and refusals by code."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in USAGE:
                out.setdefault(sample.labels["principal"], {})[USAGE[name]] = int(sample.value)
            elif name == "neuron:principal_rejections":
                who = out.setdefault(sample.labels["principal"], {})
                who[f"refused_{sample.labels['code']}"] = int(sample.value)
    return out


def _devices(health: dict[str, Any]) -> list[str]:
    lines = []
    for model, ranks in (health.get("devices") or {}).items():
        for t in ranks:
            gib = f"{t['memory_used'] / 2**30:.1f}/{t['memory_total'] / 2**30:.1f} GiB"
            extra = [f"{t['utilization']:.0f}% busy" if t["utilization"] >= 0 else "",
                     f"{t['temperature_c']:.0f} C" if t["temperature_c"] >= 0 else "",
                     f"kernels {t['cpu_isa']}, {t['threads']} threads" if t.get("cpu_isa") else ""]
            lines.append(f"  {model} rank {t['rank']} on {t['device']}: {gib}" +
                         "".join(f", {e}" for e in extra if e))
    return lines


def status(args: argparse.Namespace, daemon: Daemon) -> int:
    """Exit 0 when the daemon says it is healthy, 1 otherwise (503 is an answer, not an error)."""
    code, health = daemon.call("GET", "/health", admin=False, ok=(200, 503))
    _, listed = daemon.call("GET", "/models", admin=True)
    _, version = daemon.call("GET", "/version", admin=False)
    principals = usage(daemon.text("/metrics", admin=True))
    if args.json:
        _print({"health": health, "models": listed["models"], "version": version, "usage": principals}, True, "")
    else:
        reason = f" ({health['reason']})" if health.get("reason") else ""
        print(f"{daemon.url}: {health['status']}{reason} (neuron {version['version']})")
        if listed["models"]:
            print(table(listed["models"]))
        devices = _devices(health)
        if devices:
            print("devices:\n" + "\n".join(devices))
        if principals:
            print("usage by key:")
            for name, counts in sorted(principals.items()):
                print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0 if code == 200 else 1


def _run(handler):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args, Daemon.from_args(args))
        except CtlError as exc:
            print(f"neuron: {exc}", file=sys.stderr)
            return 1
    return run


def add_parsers(sub: argparse._SubParsersAction) -> None:
    def command(name: str, help: str, handler) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        add_connection_flags(p)
        p.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
        p.set_defaults(run=_run(handler))
        return p

    command("models", "list the daemon's models and their status", models)
    p = command("load", "load a model into the running daemon", load)
    p.add_argument("model", help="model id, HF repo id in the local cache, or a path inside [server] model_roots")
    p.add_argument("--id", help="the name clients will use (default: derived from MODEL)")
    p.add_argument("--alias", action="append", help="another name it answers to, exact or a * glob "
                   "(e.g. 'claude-*'); repeat for more")
    p.add_argument("--tensor-parallel", type=int)
    p.add_argument("--device", choices=["cpu", "cuda", "auto"])
    p.add_argument("--devices", help="GPU indices, comma-separated")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-slots", type=int)
    p = command("unload", "unload a model (its requests finish first)", unload)
    p.add_argument("id", help="the model's id, as `neuron models` shows it")
    command("status", "health and models of the daemon (exit 1 unless healthy)", status)
