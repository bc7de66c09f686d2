"""Chat templates rendered where the daemon can stop them.

A chat template is a Jinja program, from a model's files or (when the operator allows it) from a
request: ``{% for i in range(100000) %}{% for j in range(100000) %}`` runs for hours, and a thread
cannot be stopped. So every render runs in a worker process (``neuron.sandbox``): killed past
``[templates] render_timeout_s``, under an address-space limit, its output bounded, and replaced
after a job that left it large. Client templates take at most half the workers, so a model's own
template always finds one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from neuron import sandbox
from neuron.config import TemplateConfig

from .chat_template import TemplateError, TemplateTooLarge, render_chat
from neuron.errors import BadModelConfig

MODULE = "neuron.loader.template_worker"
RECYCLE_RSS_BYTES = 256 << 20  # a worker this large after a job is replaced
# What the load-time check renders with the model's template.
PROBE = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"},
         {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Say something."}]


class RenderJob(msgspec.Struct):
    template: str | None
    messages: list[Any]
    tools: list[Any] | None
    documents: list[Any] | None
    add_generation_prompt: bool
    bos_token: str | None
    eos_token: str | None
    extra: dict[str, Any]
    max_chars: int


class Rendered(msgspec.Struct):
    text: str = ""
    error: str = ""
    too_large: bool = False


_encode = msgspec.msgpack.Encoder().encode
_decode_job = msgspec.msgpack.Decoder(RenderJob).decode
_decode_reply = msgspec.msgpack.Decoder(Rendered).decode


class TemplateTimeout(TemplateError):
    """The render ran past its deadline."""


class TemplateRefused(TemplateError):
    """A request's own template, where the operator does not allow them."""


def _handle(data: bytes) -> bytes:
    job = _decode_job(data)
    try:
        text = render_chat(job.template, job.messages, tools=job.tools, documents=job.documents,
                           add_generation_prompt=job.add_generation_prompt, bos_token=job.bos_token,
                           eos_token=job.eos_token, extra=job.extra, max_chars=job.max_chars)
    except TemplateTooLarge as exc:
        return _encode(Rendered(error=str(exc), too_large=True))
    except TemplateError as exc:
        return _encode(Rendered(error=str(exc)))
    except RecursionError:
        return _encode(Rendered(error="the chat template recursed too deeply"))
    return _encode(Rendered(text=text))


class TemplateRenderer:
    """The leader's side: ``render`` as ``render_chat`` does, in a worker. Blocking: call it off
    the event loop."""

    def __init__(self, cfg: TemplateConfig, allow_client_templates: bool = False) -> None:
        self.cfg = cfg
        self.allow_client_templates = allow_client_templates
        self._pool = sandbox.WorkerPool(MODULE, workers=cfg.workers, memory_bytes=cfg.render_memory_bytes,
                                        recycle_rss_bytes=RECYCLE_RSS_BYTES)
        self._client_slots = threading.BoundedSemaphore(max(1, cfg.workers // 2))
        self._client_lane: asyncio.Semaphore | None = None

    @asynccontextmanager
    async def lane(self, from_client: bool) -> AsyncIterator[None]:
        """Entered on the event loop around the thread that renders: requests with their own
        template wait here for their share of the workers, holding no thread while they wait."""
        if not from_client or not self.allow_client_templates:
            yield
            return
        if self._client_lane is None:
            self._client_lane = asyncio.Semaphore(max(1, self.cfg.workers // 2))
        async with self._client_lane:
            yield

    def render(self, template: str | None, messages: list[dict[str, Any]], *, tools: list | None = None,
               documents: list | None = None, add_generation_prompt: bool = True, bos_token: str | None = None,
               eos_token: str | None = None, extra: dict[str, Any] | None = None,
               from_client: bool = False) -> str:
        """The rendered text; TemplateError (TemplateTimeout, TemplateTooLarge, TemplateRefused)
        says why not. ``from_client``: ``template`` came with the request."""
        if from_client and not self.allow_client_templates:
            raise TemplateRefused("chat_template: this server does not render templates sent with requests "
                                  "([server] allow_request_chat_template is off)")
        job = RenderJob(template, messages, tools, documents, add_generation_prompt, bos_token, eos_token,
                        extra or {}, self.cfg.max_output_chars)
        whose = "the request's chat_template" if from_client else "the model's chat template"
        try:
            data = _encode(job)
        except (TypeError, ValueError, OverflowError) as exc:  # msgpack's own limits (a 2**64 integer)
            raise TemplateError(f"the conversation cannot be handed to {whose}: {exc}") from None
        timeout = self.cfg.render_timeout_s
        try:
            if from_client:
                with self._client_slots:
                    reply = _decode_reply(self._pool.run(data, timeout))
            else:
                reply = _decode_reply(self._pool.run(data, timeout))
        except sandbox.JobTimeout:
            raise TemplateTimeout(f"{whose} took over {timeout:g}s to render; it was stopped") from None
        except (sandbox.JobCrashed, msgspec.DecodeError):
            raise TemplateTooLarge(f"{whose} ran out of its {self.cfg.render_memory_bytes >> 20} MiB of memory "
                                   "or crashed while rendering") from None
        if reply.too_large:
            raise TemplateTooLarge(f"{whose}: {reply.error}")
        if reply.error:
            raise TemplateError(reply.error)
        return reply.text

    def probe(self, template: str | None, bos_token: str | None, eos_token: str | None) -> None:
        """A model's own template checked at load on a short conversation: TemplateTimeout or
        TemplateTooLarge when it cannot render one within the limits (a template that refuses
        the conversation through ``raise_exception`` is the model's business)."""
        if template is None:
            return
        try:
            self.render(template, [dict(m) for m in PROBE], bos_token=bos_token, eos_token=eos_token)
        except (TemplateTimeout, TemplateTooLarge):
            raise
        except TemplateError:
            pass

    def close(self) -> None:
        self._pool.close()

    def check_model(self, spec) -> None:
        """``probe`` of a model's template (a ``ModelSpec``'s): BadModelConfig naming the model."""
        info = spec.tokenizer
        try:
            self.probe(info.chat_template, info.bos_token,
                       info.token(info.eos_token_ids[0]) if info.eos_token_ids else None)
        except TemplateError as exc:
            raise BadModelConfig(f"model {spec.id!r}: {exc}") from None


if __name__ == "__main__":
    sandbox.serve(_handle)
