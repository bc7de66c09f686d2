"""Planning a completion: its prompt(s), and for each of its choices (prompts x n) a sequence
with its constraint (grammar, forced tool call, allowed tokens, bad words) and its text pipeline
(thinking, tool calls). Runs off the event loop; ``build`` makes the sequences on it, for the
request's ``Origin``."""

from __future__ import annotations

from typing import Callable

from neuron.server.grammar.constraints import (AfterMarker, AllOf, AllowedTokens, BannedSequences, Constraint,
                                              ThinkingBudget)
from neuron.server.grammar.grammars import Compiler, GrammarError, GrammarSpec, grammars_for
from neuron.errors import ApiError
from neuron.loader.template_worker import TemplateRenderer
from protocol.engine_client import ModelView

from neuron.server.openai.choices import Choice
from neuron.server.openai.prompts import ChatPrompt, Prompt, chat_prompt, completion_prompts
from neuron.parsing.reasoning import ReasoningSplitter
from neuron.server.openai.requests import check_sequence, make_request, settings_of, truncate
from neuron.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from neuron.server.state import Origin
from neuron.server.openai.structured import output_grammar, whitespace_of
from neuron.parsing.tool_calls import PARSERS, ToolCallParser
from neuron.server.openai.tools import forced_call_grammar


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def _constraint_factory(body: SamplingFields, handle: ModelView, grammar: tuple[str, str] | None,
                        after: str | None, thinking: Callable[[], Constraint] | None = None
                        ) -> Callable[[int, int], Constraint | None] | None:
    """Makes each sequence's constraint from its token budget: the grammar (compiled once here),
    ``allowed_token_ids``, ``bad_words`` and the thinking budget; the grammar waits for ``after``
    when given."""
    info = handle.spec.tokenizer
    vocab = handle.spec.config.vocab_size
    grammars = grammars_for(info.tokenizer, vocab, info.eos_token_ids) if grammar is not None else None
    allowed = body.allowed_token_ids
    if allowed is not None and (not allowed or not all(0 <= t < vocab for t in allowed)):
        raise _bad(f"allowed_token_ids must be a non-empty list of ids in [0, {vocab})", "allowed_token_ids")
    banned = _bad_word_sequences(body, handle)
    if grammars is None and allowed is None and not banned and thinking is None:
        return None

    def make(budget: int, phase: int) -> Constraint | None:
        parts: list[Constraint] = []
        if grammars is not None and grammar is not None:
            constraint: Constraint = grammars.constraint(grammar[0], budget, phase)
            if after is not None:
                token_bytes = grammars.tokenizer.decode_bytes
                constraint = AfterMarker(constraint, after.encode(), lambda t: token_bytes([t]))
            parts.append(constraint)
        if allowed is not None:
            parts.append(AllowedTokens(allowed, vocab))
        if banned:
            parts.append(BannedSequences(banned, vocab))
        if thinking is not None:
            parts.append(thinking())
        return parts[0] if len(parts) == 1 else AllOf(parts)

    return make


def _thinking_budget(body: ChatRequest, handle: ModelView, plan: ChatPrompt) -> Callable[[], Constraint] | None:
    """``thinking_token_budget``: what bounds each sequence's thinking, or None (no budget, or
    the template closed the thinking in the prompt)."""
    budget = body.thinking_token_budget
    if budget is None or budget == -1:
        return None
    if budget < 0:
        raise _bad("thinking_token_budget must be -1 (no budget) or at least 0", "thinking_token_budget")
    markers = plan.markers
    if markers is None:
        raise _bad("thinking_token_budget: this model's chat template has no thinking markers",
                   "thinking_token_budget")
    if plan.thinking is False:
        return None
    info = handle.spec.tokenizer
    vocab = handle.spec.config.vocab_size
    decode = grammars_for(info.tokenizer, vocab, info.eos_token_ids).tokenizer.decode_bytes
    end_ids = info.tokenizer.encode(markers.end, add_special_tokens=False).ids
    start, end, thinking = markers.start.encode(), markers.end.encode(), plan.thinking
    return lambda: ThinkingBudget(budget, start, end, end_ids, vocab, lambda t: decode([t]), thinking)


def _bad_word_sequences(body: SamplingFields, handle: ModelView) -> list[list[int]]:
    words = body.bad_words or []
    if len(words) > 256 or not all(isinstance(w, str) and w.strip() for w in words):
        raise _bad("bad_words must be at most 256 non-empty strings", "bad_words")
    tk = handle.spec.tokenizer.tokenizer
    sequences = []
    for word in words:  # as vLLM: the word alone and after a space
        for text in {word.strip(), " " + word.strip()}:
            sequences.append(tk.encode(text, add_special_tokens=False).ids)
    return sequences


def _compile(handle: ModelView, compiler: Compiler, spec: GrammarSpec, param: str) -> tuple[str, str]:
    info = handle.spec.tokenizer
    grammars = grammars_for(info.tokenizer, handle.spec.config.vocab_size, info.eos_token_ids)
    try:
        return grammars.check(spec, compiler), param
    except GrammarError as exc:
        raise _bad(f"{param}: {exc}", param) from None


def plan_chat(body: ChatRequest, handle: ModelView, top: int | None, compiler: Compiler,
              templates: TemplateRenderer, fit_context: bool = False) -> tuple[ChatPrompt, Callable[[Origin], list[Choice]]]:
    """The prompt, and what makes the n choices: a forced tool call or the requested output
    format as the grammar (not both), thinking and tool-call parsing per choice. ``fit_context``
    (Anthropic's rule): a ``max_tokens`` past the context's room runs with the room there is
    (``plan.fitted``), and a prompt with no room is "prompt is too long"."""
    plan = chat_prompt(body, handle, templates)
    settings = settings_of(body, handle, top, 1, plan.shown)
    if fit_context:
        room = handle.max_len - len(plan.prompt.ids)
        if room < 1:
            raise _bad(f"prompt is too long: {len(plan.prompt.ids)} tokens > {handle.max_len - 1} maximum", "messages")
        if settings.max_tokens is not None and settings.max_tokens > room:
            settings.max_tokens, plan.fitted = room, True
    grammar = None
    wanted = output_grammar(body)
    if plan.tools is not None and plan.tools.forced:
        if wanted is not None:
            raise _bad(f"{wanted[1]} cannot be combined with tool_choice {plan.tools.choice!r}", wanted[1])
        for tool in plan.tools.tools:
            try:
                compiler.admit(GrammarSpec("json_schema", tool["function"].get("parameters") or {}))
            except GrammarError as exc:
                raise _bad(f"tools: {tool['function']['name']!r} parameters: {exc}", "tools") from None
        lark = forced_call_grammar(plan.tools, handle.spec.tokenizer, whitespace_of(body))
        grammar = _compile(handle, compiler, GrammarSpec("lark", lark), "tool_choice")
    elif wanted is not None:
        grammar = _compile(handle, compiler, *wanted)
    # A thinking model thinks first: the grammar starts after its thinking.
    after = plan.markers.end if plan.markers is not None and plan.thinking else None
    make_constraint = _constraint_factory(body, handle, grammar, after, _thinking_budget(body, handle, plan))
    ids = truncate(body, handle, plan.prompt.ids)
    images = plan.prompt.images
    if images and len(ids) != len(plan.prompt.ids):
        raise _bad("truncate_prompt_tokens cannot cut a prompt that holds images", "truncate_prompt_tokens")
    markers = plan.markers

    def build(origin: Origin) -> list[Choice]:
        return [Choice(i, make_request(body, handle, settings, ids, i, origin, make_constraint, images),
                       len(ids) if i == 0 else 0,
                       echo=plan.echo, thinking=ReasoningSplitter(markers, plan.thinking) if markers else None,
                       tools=_tool_parser(plan), include_reasoning=body.include_reasoning)
                for i in range(settings.n)]

    check_sequence(body, handle, settings, ids)
    return plan, build


def _tool_parser(plan: ChatPrompt) -> ToolCallParser | None:
    tools = plan.tools
    if tools is None:
        return None
    # Llama 3's calls are bare JSON: only a call that names one of the tools is taken for one.
    parser = PARSERS[tools.syntax](tools.names if tools.syntax == "llama3_json" else None)
    parser.max_calls = None if tools.parallel else 1
    return parser


def plan_completion(body: CompletionRequest, handle: ModelView, top: int | None,
                    compiler: Compiler) -> Callable[[Origin], list[Choice]]:
    """What makes the choices of every prompt, indexed prompt by prompt (n each)."""
    prompts: list[Prompt] = completion_prompts(body, handle)
    settings = settings_of(body, handle, top, len(prompts))
    wanted = output_grammar(body)
    grammar = _compile(handle, compiler, *wanted) if wanted is not None else None
    make_constraint = _constraint_factory(body, handle, grammar, None)
    sequences = [(truncate(body, handle, prompt.ids), prompt.text if body.echo else "") for prompt in prompts]
    for ids, _ in sequences:
        check_sequence(body, handle, settings, ids)

    def build(origin: Origin) -> list[Choice]:
        return [Choice(p * settings.n + i, make_request(body, handle, settings, ids, i, origin, make_constraint),
                       len(ids) if i == 0 else 0, echo=echo)
                for p, (ids, echo) in enumerate(sequences) for i in range(settings.n)]

    return build

