"""The leader's grammar engine (llguidance) on real tokenizers: random walks through the masks
(what a model that wants nothing of the grammar does) always end in output that parses and
validates, within the token budget; no torch on the way."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import zlib

import jsonschema
import numpy as np
import pytest

from conftest import ROOT
from neuron.config import GrammarConfig
from neuron.server.grammar.grammars import GrammarError, GrammarSpec, close_objects, grammars_for
from neuron.server.grammar.worker import GrammarCompiler
from neuron.server.grammar.budget import unpack
from devtools.checkpoints import EOS_TOKEN, build_tokenizer

COMPILER = GrammarCompiler(GrammarConfig())
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"},
                           "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["x", "ok", "tags"]}},
        "owner": {"type": "object", "properties": {"name": {"type": "string"},
                                                   "roles": {"type": "array", "items": {"enum": ["r", "w"]}}},
                  "required": ["name", "roles"], "additionalProperties": False},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "kind", "items", "owner", "note"],
}


@pytest.fixture(scope="module")
def tiny():
    """The 512-token byte-level BPE of the random test checkpoints."""
    tk = build_tokenizer()
    return tk, grammars_for(tk, tk.get_vocab_size(), [tk.token_to_id(EOS_TOKEN)])


@pytest.fixture(scope="module")
def smollm2():
    """The default model's 49k-token tokenizer, rebuilt from its GGUF."""
    from neuron.loader.spec import load_spec

    spec = load_spec("SmolLM2-135M-Instruct")
    info = spec.tokenizer
    return info.tokenizer, grammars_for(info.tokenizer, spec.config.vocab_size, info.eos_token_ids)


def walk(grammars, grammar: str, budget: int, rng: random.Random) -> tuple[list[int], str, bool]:
    """Draw uniformly among the allowed tokens until EOS or the budget; (tokens, why, closed early)."""
    constraint = grammars.constraint(grammar, budget)
    out: list[int] = []
    for _ in range(budget):
        mask = np.frombuffer(constraint.allowed(), dtype="<u4")
        assert mask.nbytes == 4 * ((grammars.vocab + 31) // 32)
        token = int(rng.choice(np.flatnonzero(unpack(mask, grammars.vocab))))
        constraint.accept(token)
        if token in grammars.eos:
            return out, "eos", constraint.closed_early
        out.append(token)
    return out, "length", constraint.closed_early


@pytest.mark.parametrize("budget", [80, 150, 400])
def test_random_walks_through_a_nested_schema_always_validate(tiny, budget):
    tk, grammars = tiny
    grammar = grammars.check(GrammarSpec("json_schema", NESTED), COMPILER)
    rng = random.Random(budget)
    for _ in range(12):
        tokens, why, _ = walk(grammars, grammar, budget, rng)
        value = json.loads(tk.decode(tokens))
        jsonschema.validate(value, NESTED)
        assert len(tokens) <= budget


@pytest.mark.parametrize("budget", [3, 8, 20, 200])
def test_any_json_object_closes_within_even_a_tight_budget(tiny, budget):
    tk, grammars = tiny
    grammar = grammars.check(GrammarSpec("json_object", None), COMPILER)
    rng = random.Random(budget)
    for _ in range(20):
        tokens, why, closed_early = walk(grammars, grammar, budget, rng)
        assert isinstance(json.loads(tk.decode(tokens)), dict)
        assert why == "eos" or closed_early


def test_streams_that_start_together_take_turns_to_re_estimate_their_way_out(tiny, monkeypatch):
    """64 JSON streams started in one step: after that step, no step re-estimates the shortest
    way of more than a ninth of them (every stream every ninth step, each at its own phase, and
    only where the way out it found before no longer holds), where all 64 at once made every
    ninth step 22 ms long."""
    from neuron.server.grammar import budget as grammar_budget

    tk, grammars = tiny
    grammar = grammars.check(GrammarSpec("json_schema", NESTED), COMPILER)
    calls = [0]
    real = grammar_budget.shortest_path

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(grammar_budget, "shortest_path", counted)
    # Far from the window (no near checks); phases as 64 prompts' own (the same prompt, the same phase).
    streams = [grammars.constraint(grammar, 4000, zlib.crc32(f"prompt {i}".encode())) for i in range(64)]
    rng = random.Random(7)
    per_step = []
    for _ in range(27):
        calls[0] = 0
        for c in streams:
            mask = np.frombuffer(c.allowed(), dtype="<u4")
            c.accept(int(rng.choice(np.flatnonzero(unpack(mask, grammars.vocab)))))
        per_step.append(calls[0])
    # everyone's first estimate, then their turns where their way out no longer holds
    assert per_step[0] >= 64 and sum(per_step[1:]) >= 64, per_step
    assert max(per_step[1:]) <= 64 // 8 + 1 + 2, per_step  # (+2: dead-end probes where the output may end)


def test_a_way_out_that_still_holds_is_checked_not_searched_for_again(tiny, monkeypatch):
    """Inside a JSON string the way out found once ('"', '}') holds token after token: the budget
    checks it each step (a microsecond) rather than search again (tens of them, and 64 streams'
    searches made steps of 13-17 ms on a 2-core box), and the ending it writes is that way, so
    the output is whole JSON at its max_tokens."""
    from neuron.server.grammar import budget as grammar_budget

    tk, grammars = tiny
    grammar = grammars.check(GrammarSpec("json_schema", {"type": "object", "properties": {"text": {"type": "string"}},
                                                         "required": ["text"]}), COMPILER)
    searches = []
    real = grammar_budget.shortest_path

    def counted(*args):
        searches.append(args[2])
        return real(*args)

    monkeypatch.setattr(grammar_budget, "shortest_path", counted)
    c = grammars.constraint(grammar, 60)
    x, eos = tk.token_to_id("x"), tk.token_to_id(EOS_TOKEN)
    out = []
    for _ in range(60):
        allowed = np.flatnonzero(unpack(np.frombuffer(c.allowed(), dtype="<u4"), grammars.vocab))
        token = x if x in allowed else int(allowed[0])  # text while it may, else what the budget leaves
        if token == eos:
            break
        c.accept(token)
        out.append(token)
    text = tk.decode(out)
    assert json.loads(text)["text"].startswith("xxxx") and len(out) <= 60, text
    in_string = [left for left in searches if left < 55]  # after the first tokens: '{"text":"'
    assert len(in_string) <= 2, searches


def test_a_budget_below_the_shortest_valid_output_ends_by_length(tiny):
    tk, grammars = tiny
    grammar = grammars.check(GrammarSpec("json_schema", NESTED), COMPILER)
    tokens, why, closed_early = walk(grammars, grammar, 10, random.Random(0))
    assert why == "length" and len(tokens) == 10 and not closed_early  # no ending fits: nothing is steered


@pytest.mark.parametrize("budget", [40, 90, 160])
def test_a_repetition_is_not_begun_when_the_budget_cannot_finish_it(tiny, budget):
    """As parallel tool calls: after each whole item the output may end or begin another; one
    begun too late would be cut off unfinished, so the output ends instead."""
    tk, grammars = tiny
    item = {"type": "object", "properties": {"name": {"enum": ["get_weather", "get_time"]},
                                             "arguments": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                           "required": ["tz"], "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}}
    grammar = grammars.check(GrammarSpec("lark", f'start: item ("\\n" item)*\nitem: %json {json.dumps(item)}\n'), COMPILER)
    rng = random.Random(budget)
    for _ in range(12):
        tokens, why, closed_early = walk(grammars, grammar, budget, rng)
        assert why == "eos" or closed_early
        for line in tk.decode(tokens).split("\n"):
            jsonschema.validate(json.loads(line), item)


def test_the_default_models_tokenizer_walks_a_schema_too(smollm2):
    tk, grammars = smollm2
    grammar = grammars.check(GrammarSpec("json_schema", NESTED), COMPILER)
    rng = random.Random(7)
    for _ in range(3):
        tokens, _, _ = walk(grammars, grammar, 150, rng)
        jsonschema.validate(json.loads(tk.decode(tokens)), NESTED)


def test_regex_choice_and_gbnf_grammars_hold(tiny):
    tk, grammars = tiny
    rng = random.Random(3)
    regex = grammars.check(GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"), COMPILER)
    choice = grammars.check(GrammarSpec("choice", ["yes", "no", "maybe so"]), COMPILER)
    gbnf = grammars.check(GrammarSpec("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), COMPILER)
    for _ in range(20):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", tk.decode(walk(grammars, regex, 20, rng)[0]))
        assert tk.decode(walk(grammars, choice, 20, rng)[0]) in ("yes", "no", "maybe so")
        assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", tk.decode(walk(grammars, gbnf, 30, rng)[0]))


def test_whitespace_between_json_tokens_is_one_space_or_an_indented_line(tiny):
    tk, grammars = tiny
    grammar = grammars.check(GrammarSpec("json_schema", NESTED), COMPILER)
    rng = random.Random(11)
    for _ in range(10):
        text = tk.decode(walk(grammars, grammar, 200, rng)[0])
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert all(re.fullmatch(r"[ \t]|\r?\n[ \t]{0,32}", run) for run in re.findall(r"\s+", outside)), outside


def test_no_additional_properties_closes_every_open_object():
    closed = close_objects({"type": "object", "properties": {"a": {"type": "object"}, "b": {"enum": [{"x": 1}]}}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"] == {"enum": [{"x": 1}]}


@pytest.mark.parametrize("spec", [
    GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
    GrammarSpec("regex", "(unclosed"),
    GrammarSpec("choice", []),
    GrammarSpec("grammar", "root ::= missing_rule"),
])
def test_a_grammar_that_does_not_compile_is_an_error_with_a_reason(tiny, spec):
    _, grammars = tiny
    with pytest.raises(GrammarError) as info:
        grammars.check(spec, COMPILER)
    assert str(info.value)


def test_the_grammar_engine_runs_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch on the leader')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from neuron.config import GrammarConfig\n"
        "from neuron.server.grammar.grammars import GrammarSpec, grammars_for\n"
        "from neuron.server.grammar.worker import GrammarCompiler\n"
        "from devtools.checkpoints import build_tokenizer\n"
        "tk = build_tokenizer()\n"
        "g = grammars_for(tk, tk.get_vocab_size(), [tk.token_to_id('<|im_end|>')])\n"
        "c = g.constraint(g.check(GrammarSpec('json_object', None), GrammarCompiler(GrammarConfig())), 16)\n"
        "assert len(c.allowed()) == 64\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
