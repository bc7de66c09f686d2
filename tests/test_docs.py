"""The documentation inside the repository keeps up with the code: every link leads to a file of
the repository, every configuration key, route, metric and error code is documented."""

from __future__ import annotations

import dataclasses
import re
import tomllib

from conftest import ROOT

DOCS = ROOT / "docs"
PAGES = ["api.md", "configuration.md", "operations.md", "architecture.md", "gpu.md", "multihost.md"]


def test_the_readme_keeps_its_first_two_commands():
    commands = [line.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("    ")]
    assert commands[:2] == ["./scripts/setup && .venv/bin/neuron serve",
                            "./scripts/setup --test && .venv/bin/python -m pytest -q -ra -n 2 --dist loadfile"]
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()  # CI runs the README's command


def test_every_link_in_the_readme_and_the_docs_leads_to_a_file_in_the_repository():
    files = [ROOT / "README.md", *(DOCS / page for page in PAGES)]
    assert all(f.is_file() for f in files)
    for f in files:
        text = f.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text and "API.md" not in text, f
        for target in re.findall(r"\]\(([^)]+)\)", text):
            assert "://" not in target, (f, target)
            path = (f.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), (f, target)


def test_every_configuration_key_is_in_the_toml_file_and_in_configuration_md():
    from neuron.config import Config, ModelEntry

    toml = tomllib.loads((ROOT / "conf" / "neuron.toml").read_text())
    page = (DOCS / "configuration.md").read_text()
    defaults = Config()
    for section in dataclasses.fields(Config):
        kind = ModelEntry if section.name == "models" else type(getattr(defaults, section.name))
        in_file = toml[section.name][0] if section.name == "models" else toml[section.name]
        for key in dataclasses.fields(kind):
            assert key.name in in_file, f"[{section.name}] {key.name} missing from conf/neuron.toml"
            assert f"| `{key.name}` |" in page, f"[{section.name}] {key.name} missing from docs/configuration.md"


def test_the_toml_file_shows_the_defaults():
    from neuron.config import Config, load_config

    assert load_config(ROOT / "conf" / "neuron.toml", env={}) == Config()


def test_every_route_and_error_code_is_in_api_md():
    from neuron.server.routes import route_table

    page = (DOCS / "api.md").read_text()
    for route in route_table():
        assert f"`{route.method} {route.path}`" in page, route.path
    sources = "\n".join(p.read_text() for p in (ROOT / "neuron").rglob("*.py"))
    codes = set(re.findall(r'ApiError\(\d+, "([a-z_]+)"', sources)) | set(re.findall(r'code = "([a-z_]+)"', sources))
    codes |= {"insufficient_memory", "method_not_allowed"}  # made from error kinds and Starlette's 405
    assert len(codes) > 10
    for code in codes:
        assert f"`{code}`" in page, code


def test_every_metric_is_in_operations_md():
    from prometheus_client.parser import text_string_to_metric_families

    from neuron.server.metrics import Metrics

    page = (DOCS / "operations.md").read_text()
    families = {f.name for f in text_string_to_metric_families(Metrics().render({}).decode())}
    assert len(families) >= 12
    for name in families:  # counters are shown with their _total sample name
        assert f"`{name}" in page, name
