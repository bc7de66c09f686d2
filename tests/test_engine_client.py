"""Both engine clients (in process, and an API process's over ZeroMQ) are what
``protocol/engine_client.py`` says the HTTP side may use: every method there, with its
parameters, async where it is async; every attribute there, set by each model and engine. The
behaviour of each is the rest of the suite's (``test_api*.py`` run both)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import pytest

from protocol import engine_client as ec

from neuron.core.link import Sink
from neuron.engine.client import LocalEngine, LocalSink
from neuron.local_client import LocalClient
from neuron.model_handle import ModelHandle
from neuron.server.core_client import CoreClient, CoreEngine, CoreModel
from neuron.server.output.state import OutputState
from neuron.server.state import AppState

PAIRS = [(ec.EngineClient, LocalClient), (ec.EngineClient, CoreClient), (ec.ModelView, ModelHandle),
         (ec.ModelView, CoreModel), (ec.ModelEngine, LocalEngine), (ec.ModelEngine, CoreEngine),
         (ec.OutputSink, LocalSink), (ec.OutputSink, Sink), (ec.Submitted, OutputState)]


def members(protocol: type) -> tuple[dict[str, object], set[str]]:
    """(methods and properties by name, attribute names) the protocol declares."""
    own = {name: value for name, value in vars(protocol).items() if not name.startswith("_")
           and (callable(value) or isinstance(value, property))}
    return own, set(protocol.__annotations__)


def attributes_of(cls: type) -> set[str]:
    """What every instance of ``cls`` has: its class's names, dataclass fields, and what its
    ``__init__`` (or a base's) assigns to ``self``."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None and inspect.isfunction(init) and not dataclasses.is_dataclass(klass):
            source = inspect.getsource(init)
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", source))
            names |= {n for group in re.findall(r"self\.(\w+(?:, self\.\w+)+)\s*=", source)
                      for n in group.replace("self.", "").split(", ")}
    return names


@pytest.mark.parametrize("protocol,cls", PAIRS, ids=[f"{p.__name__}-{c.__name__}" for p, c in PAIRS])
def test_each_implementation_has_what_the_protocol_declares(protocol, cls):
    methods, attributes = members(protocol)
    assert methods or attributes
    for name, declared in methods.items():
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        got = getattr(cls, name)
        if isinstance(declared, property):
            assert isinstance(got, property) or name in attributes_of(cls), (cls.__name__, name)
            continue
        want = [p for p in inspect.signature(declared).parameters.values()]
        have = [p for p in inspect.signature(got).parameters.values()]
        # The protocol's parameters first, as it has them; any more only with defaults.
        assert [(p.name, p.kind, p.default) for p in have[:len(want)]] == \
            [(p.name, p.kind, p.default) for p in want], (cls.__name__, name, have)
        assert all(p.default is not p.empty for p in have[len(want):]), (cls.__name__, name, have)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(declared), (cls.__name__, name)
    missing = attributes - attributes_of(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"


def test_the_app_state_holds_an_engine_client_and_nothing_else_of_the_engine():
    hints = typing.get_type_hints(AppState, localns=vars(ec))
    assert hints["engine_client"] is ec.EngineClient
    assert not any("registry" in name.lower() for name in hints)
