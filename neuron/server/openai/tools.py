"""Tools of a chat request: validating them and ``tool_choice``, the model's tool-call syntax
(configured per model, or found in its chat template), the grammar that forces a call in that
syntax (``tool_choice`` "required" or a named function), and, for a template that ignores tools,
a Hermes-style tool prompt of our own so that every model can call tools."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from neuron.errors import ApiError
from neuron.loader.tokenizer import TokenizerInfo



def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tools: {"type": "function", "function": {...}}
    choice: str  # auto | required | named
    name: str | None  # the function of a named tool_choice
    parallel: bool
    syntax: str  # hermes | llama3_json | mistral

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def check_tools(raw: Any, param: str = "tools") -> list[dict[str, Any]]:
    """OpenAI function tools, each checked: a name, an optional description, an object schema."""
    if not isinstance(raw, list):
        raise _bad("tools must be a list", param)
    tools = []
    for i, tool in enumerate(raw):
        where = f"{param}.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad("only tools of type 'function' are supported", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad("a tool needs a 'function' object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise _bad("a function needs a name (1 to 128 characters)", f"{where}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad("a function's parameters must be a JSON schema object", f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad("a function's description must be a string", f"{where}.function.description")
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tool names must be unique", param)
    return tools


def plan_tools(tools_raw: Any, choice_raw: Any, parallel: bool | None, syntax: str) -> ToolPlan | None:
    """None when no tool is offered or ``tool_choice`` is "none": nothing rendered, nothing parsed."""
    if choice_raw is None:
        choice_raw = "auto" if tools_raw else "none"
    if choice_raw == "none" or (choice_raw == "required" and tools_raw == []):
        return None
    if tools_raw is None:
        raise _bad("tool_choice needs tools", "tool_choice")
    tools = check_tools(tools_raw)
    name = None
    if choice_raw in ("auto", "required"):
        choice = choice_raw
    elif isinstance(choice_raw, dict) and choice_raw.get("type", "function") == "function":
        fn = choice_raw.get("function") if "function" in choice_raw else choice_raw  # chat | responses shape
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise _bad("tool_choice names a function that is not among the tools", "tool_choice")
        choice = "named"
    else:
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", '
                   '"function": {"name": ...}}', "tool_choice")
    if not tools:
        return None
    return ToolPlan(tools, choice, name, parallel is not False and choice != "named", syntax)


def detect_syntax(setting: str, template: str | None) -> str:
    """The configured syntax, or the one the template writes calls in (Hermes when it has none:
    the tool prompt we add then asks for that)."""
    if setting not in ("auto", "none"):
        return setting
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters": dictionary of argument name' in text:
        return "llama3_json"
    return "hermes"


# ------------------------------------------------------------------------- forced calls


def _literal(info: TokenizerInfo, text: str) -> str:
    """A Lark literal for ``text``; a marker that is one special token is named by its id (the
    grammar engine never spells special tokens out of bytes)."""
    tid = info.tokenizer.token_to_id(text)
    if tid is not None:
        added = info.tokenizer.get_added_tokens_decoder().get(tid)
        if added is not None and added.special:
            return f"<[{tid}]>"
    return json.dumps(text)


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def forced_call_grammar(plan: ToolPlan, info: TokenizerInfo, whitespace: str | None) -> str:
    """Lark (llguidance) for one call, or one or more, of the plan's tools in its syntax."""
    tools = [t for t in plan.tools if plan.name is None or t["function"]["name"] == plan.name]
    options: dict[str, Any] = {"whitespace_flexible": False}
    if whitespace is not None:
        options["whitespace_pattern"] = whitespace
    args_key = "parameters" if plan.syntax == "llama3_json" else "arguments"
    one = {"anyOf": [_call_schema(t, args_key) for t in tools], "x-guidance": options}
    if plan.syntax == "mistral":
        array = {"type": "array", "items": one, "minItems": 1, "x-guidance": options}
        if not plan.parallel:
            array["maxItems"] = 1
        return f"start: {_literal(info, '[TOOL_CALLS]')} calls\ncalls: %json {json.dumps(array)}\n"
    if plan.syntax == "llama3_json":
        call, sep = "call", '"; "'
    else:
        call = "block"
        start, end = _literal(info, "<tool_call>"), _literal(info, "</tool_call>")
        sep = '"\\n"'
    lines = [f"start: {call}" + (f" ({sep} {call})*" if plan.parallel else "")]
    if call == "block":
        lines.append(f'block: {start} "\\n" call "\\n" {end}')
    lines.append(f"call: %json {json.dumps(one)}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- templates without tools

_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that ignores ``tools``: the tool prompt in the system
    message, earlier calls as ``<tool_call>`` text and results as ``<tool_response>`` user turns
    (what Hermes-style models were trained on)."""
    prompt = _TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
            m = {"role": "assistant", "content": content}
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _call_text(call: Any) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
