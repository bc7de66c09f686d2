"""Compiling client grammars where a crash cannot reach the leader.

llguidance is native code: a grammar whose rules chain thousands deep overflows its stack and
kills the process (SIGSEGV, nothing logged), and some inputs make it panic or run long. So every
grammar a client sends is first compiled by a worker process (``python -m
neuron.server.grammar.worker``): the JSON schema, regex, choice or Lark text turned into
llguidance's grammar, checked against the model's tokenizer, a matcher built and its first mask
computed. The worker runs each job on a thread whose stack is a quarter of the leader's, under an
address-space limit, and is killed past the time limit (``neuron.sandbox``). Only a grammar that
passed there is built again on the leader, whose deeper stack it cannot exhaust.
"""

from __future__ import annotations

import hashlib
import os
import resource
import threading
from collections import OrderedDict
from typing import Any

import msgspec

from neuron import sandbox
from neuron.config import GrammarConfig

from .grammars import Grammars, GrammarError, GrammarSpec
from .limits import check_limits

# The leader builds matchers and masks on threads with at least this much stack (its main
# thread's RLIMIT_STACK, default 8 MiB); the worker gets a quarter of the smallest of them.
MIN_WORKER_STACK = 256 * 1024


class Job(msgspec.Struct, tag=True):
    tokenizer_key: str
    kind: str
    source: Any
    whitespace: str | None
    no_additional_properties: bool


class Tokenizer(msgspec.Struct, tag=True):
    key: str
    json: str
    vocab: int
    eos: list[int]


class Done(msgspec.Struct, tag=True):
    grammar: str = ""
    error: str = ""


_decode_request = msgspec.msgpack.Decoder(Job | Tokenizer).decode
_decode_reply = msgspec.msgpack.Decoder(Done).decode
_encode = msgspec.msgpack.Encoder().encode


def leader_stack_bytes() -> int:
    """The smallest stack the leader runs llguidance on: its main thread's (RLIMIT_STACK)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return 8 * 1024 * 1024 if soft in (resource.RLIM_INFINITY, -1) else soft


# ---------------------------------------------------------------------------------------- worker
def _compile(tokenizers: dict[str, Any], job: Job) -> Done:
    import llguidance as llg

    from .grammars import to_lark_grammar

    tokenizer = tokenizers.get(job.tokenizer_key)
    if tokenizer is None:
        return Done(error="internal: the worker does not know this tokenizer")
    try:
        grammar = to_lark_grammar(GrammarSpec(job.kind, job.source, job.whitespace, job.no_additional_properties))
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            return Done(error=messages[0] if messages else "the grammar does not compile")
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        matcher.compute_ff_tokens()
        matcher.compute_bitmask()
        if matcher.is_error():
            return Done(error=matcher.get_error())
        return Done(grammar=grammar)
    except GrammarError as exc:
        return Done(error=str(exc))
    except BaseException as exc:  # a panic in the native code arrives as pyo3's PanicException
        return Done(error=f"the grammar engine failed: {str(exc)[:300]}")


def worker_main() -> None:
    """The worker's loop: learn tokenizers, compile jobs, one at a time, on a small stack."""
    import llguidance as llg

    stack = int(os.environ.get("NEURON_GRAMMAR_STACK", "2097152"))
    threading.stack_size(max(stack, MIN_WORKER_STACK))
    tokenizers: dict[str, Any] = {}

    def handle(data: bytes) -> bytes | None:
        msg = _decode_request(data)
        if isinstance(msg, Tokenizer):
            tokenizers[msg.key] = llg.LLTokenizer(msg.json, n_vocab=msg.vocab, eos_token=msg.eos or None)
            return None
        reply: list[Done] = []
        thread = threading.Thread(target=lambda: reply.append(_compile(tokenizers, msg)))
        thread.start()
        thread.join()
        return _encode(reply[0] if reply else Done(error="the grammar engine failed"))

    sandbox.serve(handle)


# ---------------------------------------------------------------------------------------- leader
class GrammarCompiler:
    """The leader's side: a few worker processes, each used by one job at a time, and the
    grammars already passed (the same schema or tool list comes with request after request)."""

    def __init__(self, limits: GrammarConfig, remembered: int = 256) -> None:
        self.limits = limits
        stack = max(MIN_WORKER_STACK, leader_stack_bytes() // 4)
        self._pool = sandbox.WorkerPool("neuron.server.grammar.worker", workers=limits.compile_workers,
                                        memory_bytes=limits.compile_memory_bytes,
                                        env={"NEURON_GRAMMAR_STACK": str(stack)})
        self._lock = threading.Lock()
        self._passed: OrderedDict[bytes, str] = OrderedDict()
        self._remembered = remembered

    def compile(self, grammars: Grammars, spec: GrammarSpec) -> str:
        """llguidance's grammar for ``spec``, compiled and checked in a worker; a GrammarError
        says why it was refused. Blocking: call it off the event loop."""
        self.admit(spec)
        tokenizer = Tokenizer(grammars.key, grammars.source, grammars.vocab, grammars.eos)
        job = Job(tokenizer.key, spec.kind, spec.source, spec.whitespace, spec.no_additional_properties)
        key = hashlib.sha256(_encode(job)).digest()
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return self._passed[key]
        try:
            done = _decode_reply(self._pool.run(_encode(job), self.limits.compile_timeout_s,
                                                prelude=(tokenizer.key, _encode(tokenizer))))
        except sandbox.JobTimeout:
            raise GrammarError(f"compiling it took over {self.limits.compile_timeout_s:g}s") from None
        except (sandbox.JobCrashed, msgspec.DecodeError):
            raise GrammarError("the grammar engine crashed on it (nested or chained too deeply, or too large)") \
                from None
        if done.error:
            raise GrammarError(done.error)
        with self._lock:
            self._passed[key] = done.grammar
            while len(self._passed) > self._remembered:
                self._passed.popitem(last=False)
        return done.grammar

    def admit(self, spec: GrammarSpec) -> None:
        check_limits(spec, self.limits)

    def close(self) -> None:
        self._pool.close()


if __name__ == "__main__":
    worker_main()
