"""``neuron chat``: a terminal conversation with a running daemon. One line in is one user turn;
the answer streams out as it is generated and joins the conversation. ``/exit`` (or end of
input) quits, ``/reset`` forgets the conversation. Works with stdin from a pipe too: then no
prompt is printed, only the answers, one per turn."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterator, TextIO

import httpx

from .client import CtlError, Daemon, add_connection_flags, describe_error


def stream_answer(daemon: Daemon, body: dict[str, Any]) -> Iterator[str]:
    """The content deltas of one streamed chat completion."""
    try:
        with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", json=body, headers=daemon.headers(False),
                          timeout=httpx.Timeout(30.0, read=None)) as r:
            if r.status_code != 200:
                r.read()
                try:
                    data = r.json()
                except ValueError:
                    data = None
                raise CtlError(describe_error(r.status_code, data, r.text))
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # a failure mid-stream comes in-band
                    raise CtlError(describe_error(503, chunk, line))
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text
    except httpx.ConnectError:
        raise CtlError(f"cannot reach {daemon.url} (is `neuron serve` running there?)") from None
    except httpx.HTTPError as exc:
        raise CtlError(f"the stream broke: {type(exc).__name__}: {exc}") from None


def default_model(daemon: Daemon) -> str:
    _, data = daemon.call("GET", "/v1/models", admin=False)
    models = [m["id"] for m in data.get("data", [])]
    if not models:
        raise CtlError("the daemon serves no model (load one with `neuron load`)")
    return models[0]


def _lines(stdin: TextIO, interactive: bool) -> Iterator[str]:
    while True:
        if interactive:
            try:
                yield input("> ")
            except EOFError:
                print()
                return
        else:
            line = stdin.readline()
            if not line:
                return
            yield line.rstrip("\n")


def chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    daemon = Daemon.from_args(args)
    interactive = stdin.isatty()
    try:
        model = args.model or default_model(daemon)
    except CtlError as exc:
        print(f"neuron: {exc}", file=sys.stderr)
        return 1
    if interactive:
        print(f"chatting with {model} at {daemon.url}; /exit quits, /reset forgets", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    failed = False
    for line in _lines(stdin, interactive):
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
        for key in ("temperature", "max_tokens", "seed"):
            if getattr(args, key) is not None:
                body[key] = getattr(args, key)
        answer: list[str] = []
        try:
            for delta in stream_answer(daemon, body):
                answer.append(delta)
                out.write(delta)
                out.flush()
        except CtlError as exc:
            out.write("\n")
            print(f"neuron: {exc}", file=sys.stderr)
            messages.pop()  # the turn never happened; the user may say it again
            failed = True
            continue
        except KeyboardInterrupt:  # stop this answer, keep what came
            out.write(" [interrupted]")
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(answer)})
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model of the running daemon (streams; /exit quits)",
                       description=__doc__)
    add_connection_flags(p)
    p.add_argument("--model", help="model id (default: the first the daemon lists)")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.set_defaults(run=chat)
