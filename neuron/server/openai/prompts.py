"""Prompts: a chat rendered through the model's template (tools, documents, template options,
prefilled assistant turns), or the prompts of a text completion (one or several, text or token
ids), tokenized. Runs off the event loop."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from protocol.api_core import Image
from neuron.errors import ApiError
from neuron.loader.chat_template import TemplateError
from neuron.loader.template_worker import TemplateRenderer
from neuron.loader.tokenizer import TokenizerInfo, encode_ids
from protocol.engine_client import ModelView

from neuron.parsing.reasoning import ThinkMarkers, reasoning_markers, starts_thinking
from neuron.server.schemas import ChatRequest, CompletionRequest
from neuron.server.openai.image_prompts import ImageReader
from neuron.server.openai.tools import ToolPlan, detect_syntax, plan_tools, with_tool_prompt


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(400, "invalid_request", message, param=param)


@dataclass
class Prompt:
    ids: list[int]
    text: str = ""  # what the completion's echo repeats
    images: list[Image] = field(default_factory=list)  # at their image-pad tokens in ``ids``


@dataclass
class ChatPrompt:
    prompt: Prompt
    tools: ToolPlan | None = None
    markers: ThinkMarkers | None = None
    thinking: bool | None = None  # the template leaves the model inside its thinking
    echo: str = ""  # chat echo: the final assistant message that the answer continues
    shown: set[int] = field(default_factory=set)  # special tokens the answer's text must show
    fitted: bool = False  # max_tokens was cut to the context's room (plan_chat's fit_context)


IMAGE_PARTS = ("image_url", "input_image", "image")


def chat_messages(body: ChatRequest, images: ImageReader) -> list[dict[str, Any]]:
    _check(bool(body.messages), "messages", "messages must not be empty")
    messages = []
    for i, m in enumerate(body.messages):
        _check(m.role in ("system", "user", "assistant", "tool", "developer"), f"messages.{i}.role",
               f"unknown role {m.role[:40]!r}")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type in IMAGE_PARTS:
                    _check(m.role == "user", f"messages.{i}.content.{j}", "only user messages may hold images")
                    texts.append(images.part(part, f"messages.{i}.content.{j}"))
                    continue
                _check(part.type in ("text", "input_text", "output_text"), f"messages.{i}.content",
                       f"content part type {part.type[:40]!r} is not supported")
                texts.append(part.text or "")
            content = "".join(texts)
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.reasoning is not None and "reasoning_content" not in message:
            message["reasoning_content"] = m.reasoning
        if m.tool_calls is not None:
            message["tool_calls"] = [_call_for_template(c, f"messages.{i}.tool_calls.{j}")
                                     for j, c in enumerate(m.tool_calls)]
        messages.append(message)
    return messages


def _call_for_template(call: dict[str, Any], param: str) -> dict[str, Any]:
    """A call as templates read it: arguments as an object, not the JSON text OpenAI sends."""
    fn = call.get("function")
    _check(isinstance(fn, dict) and isinstance(fn.get("name"), str), param, "a tool call needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # the template gets the text
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


SHOWS_TOOLS_WORK = 50_000_000  # characters _shows_tools may scan (names x text): ~0.05 s


def _shows_tools(text: str, messages: list[dict[str, Any]], tools: ToolPlan) -> bool:
    """Whether the template certainly rendered the tools: each tool's name appears in ``text``
    more often than anywhere in the conversation. Where not, the caller renders again without
    tools to find out; so a template that shows tools costs one render, not two. A request of
    so many tools that the scan would cost more than a render takes the render."""
    said = json.dumps(messages, ensure_ascii=False)
    names = tools.names
    if len(names) * (len(text) + len(said)) > SHOWS_TOOLS_WORK:
        return False
    return all(text.count(name) > said.count(name) for name in names)


# A prompt is refused unread where even the vocabulary's longest tokens could not fit it: a token
# stands for at most as many bytes as its own string holds in UTF-8 (byte-level BPE's characters
# and SentencePiece's "<0x41>" and "\u2581" hold more), so a prompt of more bytes than PROMPT_SLACK x
# that x the context has more tokens than the context holds. The slack covers normalizers that
# shrink a text before it is cut (NFC, stripped accents). A 4 MiB prompt no longer costs the
# leader seconds of tokenizing to learn that it does not fit.
PROMPT_SLACK = 4
_longest: dict[int, tuple[Any, int]] = {}


def longest_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the longest token string of ``tokenizer``'s vocabulary (its own once)."""
    held = _longest.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        held = _longest[id(tokenizer)] = (tokenizer, max((len(t.encode("utf-8", "surrogatepass")) for t in vocab),
                                                         default=1))
    return held[1]


def encode_prompt(info: TokenizerInfo, text: str, add_special_tokens: bool, max_len: int | None,
                  param: str) -> list[int]:
    """``text``'s token ids, or 400 ``context_length_exceeded`` before tokenizing where its bytes
    alone say it cannot fit ``max_len`` tokens (None: no bound, as ``/tokenize`` counts any text)."""
    if max_len is None:
        return encode_ids(info.tokenizer, text, add_special_tokens)
    bound = PROMPT_SLACK * longest_token_bytes(info.tokenizer) * max_len
    if 4 * len(text) > bound and (size := len(text.encode("utf-8", "surrogatepass"))) > bound:
        raise ApiError(400, "context_length_exceeded",
                       f"this model's maximum context length is {max_len} tokens; a prompt of {size} bytes holds "
                       f"more (no token of this vocabulary is longer than {longest_token_bytes(info.tokenizer)} "
                       f"bytes)", param=param)
    return encode_ids(info.tokenizer, text, add_special_tokens)


def _render(templates: TemplateRenderer, info: TokenizerInfo, template: str | None, from_client: bool,
            messages: list[dict[str, Any]], *, tools: list | None, documents: list | None,
            add_generation_prompt: bool, extra: dict[str, Any]) -> str:
    try:
        return templates.render(template, messages, tools=tools, documents=documents,
                                add_generation_prompt=add_generation_prompt, bos_token=info.bos_token,
                                eos_token=info.token(info.eos_token_ids[0]) if info.eos_token_ids else None,
                                extra=extra, from_client=from_client)
    except TemplateError as exc:
        raise ApiError(400, "invalid_request", str(exc), param="chat_template" if from_client else "messages") \
            from None


def chat_prompt(body: ChatRequest, handle: ModelView, templates: TemplateRenderer, *, fit: bool = True) -> ChatPrompt:
    """``fit``: refuse unread a prompt that cannot fit the context (``encode_prompt``)."""
    info = handle.spec.tokenizer
    entry = handle.entry
    from_client = body.chat_template is not None
    template = body.chat_template if from_client else info.chat_template
    reader = ImageReader(handle.spec.config.vision, info.tokenizer, body.model, handle.spec.no_vision,
                         handle.client.cfg.image_pixels_per_request)
    messages = chat_messages(body, reader)
    extra = dict(body.chat_template_kwargs or {})
    for name, value in (("reasoning_effort", body.reasoning_effort), ("documents", body.documents)):
        if value is not None:
            _check(template is not None and name in template, name,
                   f"{name}: this model's chat template does not use it")
    if body.reasoning_effort is not None:
        extra["reasoning_effort"] = body.reasoning_effort
    if body.continue_final_message:
        _check(not body.add_generation_prompt, "continue_final_message",
               "continue_final_message and add_generation_prompt cannot both be true")
        _check(messages[-1]["role"] == "assistant" and bool(messages[-1]["content"]), "continue_final_message",
               "continue_final_message needs a final assistant message with content")
    tool_setting = getattr(entry, "tool_parser", "auto")
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, detect_syntax(tool_setting, template))
    _check(tools is None or tool_setting != "none", "tools", "tool calling is turned off for this model")

    def render(msgs: list[dict[str, Any]], with_tools: list | None) -> str:
        return _render(templates, info, template, from_client, msgs, tools=with_tools, documents=body.documents,
                       add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                       extra=extra)

    text = render(messages, tools.tools if tools else None)
    if tools is not None and not _shows_tools(text, messages, tools) and text == render(messages, None):
        # The template ignores tools: our own tool prompt, in the syntax it asks for.
        tools.syntax = "hermes"
        text = render(with_tool_prompt(messages, tools.tools), None)
    if body.continue_final_message:
        final = messages[-1]["content"]
        at = text.rfind(final)
        _check(at >= 0, "continue_final_message", "the template does not show the final message as given")
        text = text[: at + len(final)]
    encoded = encode_prompt(info, text, body.add_special_tokens, handle.max_len if fit else None, "messages")
    ids, images = reader.expand(encoded if body.add_special_tokens else _with_bos(info, encoded))
    markers = reasoning_markers(getattr(entry, "reasoning_parser", "auto"), template)
    out = ChatPrompt(Prompt(ids, text, images), tools, markers, starts_thinking(text, markers) if markers else None)
    if body.echo and messages[-1]["role"] == "assistant":
        out.echo = messages[-1]["content"]
    marker_texts = [markers.start, markers.end] if markers else []
    if tools is not None:
        marker_texts += {"hermes": ["<tool_call>", "</tool_call>"], "mistral": ["[TOOL_CALLS]", "[ARGS]"],
                         "llama3_json": ["<|python_tag|>"]}[tools.syntax]
    out.shown = {t for t in (info.tokenizer.token_to_id(m) for m in marker_texts) if t is not None}
    return out


def completion_prompts(body: CompletionRequest, handle: ModelView, *, fit: bool = True) -> list[Prompt]:
    """One prompt per string or token-id list of ``prompt``; ``fit`` as ``chat_prompt``'s."""
    raw = body.prompt
    vocab = handle.spec.config.vocab_size
    info = handle.spec.tokenizer
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        items = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        items = raw
    else:
        raise ApiError(400, "invalid_request", "prompt must be a string, a list of strings, a list of token ids "
                       "or a list of such lists", param="prompt")
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt.{i}"
        if isinstance(item, str):
            _check(item != "", param, "a prompt must not be empty")
            ids = encode_prompt(info, item, body.add_special_tokens, handle.max_len if fit else None, param)
            prompts.append(Prompt(_with_bos(info, ids) if body.add_special_tokens else ids, item))
            continue
        _check(bool(item) and all(isinstance(t, int) and not isinstance(t, bool) for t in item), param,
               "a token-id prompt must be a non-empty list of integers")
        _check(all(0 <= t < vocab for t in item), param, f"token ids must be in [0, {vocab})")
        prompts.append(Prompt(list(item), info.tokenizer.decode(item, skip_special_tokens=False) if body.echo else ""))
    return prompts


def _with_bos(info: TokenizerInfo, ids: list[int]) -> list[int]:
    if info.add_bos and info.bos_token:
        bos = info.tokenizer.token_to_id(info.bos_token)
        if bos is not None and (not ids or ids[0] != bos):
            return [bos, *ids]
    return ids
