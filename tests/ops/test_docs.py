"""The operating docs: their commands parse, their YAML loads, their names are real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.cli import build_parser
from gateway.counters.factory import parse_counter_url
from gateway.policy.loader import RuleLoadError, load_rules_from_texts
from gateway.settings import load_settings
from gateway.upstreams.control_plane.config import ControlPlaneConfig
from gateway.upstreams.store.config import StoreConfig
from tests.ops.helpers import (
    CLIENT_ENV,
    DOCS,
    ENV_NAME,
    PLACEHOLDER,
    ROOT,
    build_env_names,
    code_blocks,
    gateway_argv,
    metric_families,
    sample_index,
    setting_env_names,
    shell_commands,
)
from tests.ops.test_dashboard import METRIC


def _gateway_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        for block in code_blocks(doc):
            for command in shell_commands(block):
                argv = gateway_argv(command)
                if argv is None or PLACEHOLDER.search(command):
                    continue
                found.append((f"{doc.name}:{block.line}", command, argv))
    return found


COMMANDS = _gateway_commands()


def test_the_docs_show_gateway_commands():
    assert len(COMMANDS) >= 12
    assert {argv[0] for _, _, argv in COMMANDS} >= {"serve", "rules", "deployments"}


@pytest.mark.parametrize(("where", "command", "argv"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_gateway_commands_in_the_docs_parse(where, command, argv, capsys):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `{command}` does not parse:\n{capsys.readouterr().err}")
    assert args.command == argv[0]
    if args.command == "serve" and not args.config:
        # The values are valid too, as `gateway serve` would read them.
        flags = {k: v for k, v in vars(args).items() if k not in ("func", "command", "config")}
        settings = load_settings(flags, env={})
        for region in settings.region_table():
            if region.counter_url:
                parse_counter_url(region.counter_url)


def _yaml_blocks(name: str) -> list:
    return [b for b in code_blocks(ROOT / "docs" / name) if b.lang == "yaml"]


RULE_BLOCKS = [b for b in _yaml_blocks("rules.md") if "rules:" in b.text]


@pytest.mark.parametrize("block", RULE_BLOCKS, ids=lambda b: f"rules.md:{b.line}")
def test_rule_examples_load_or_fail_as_they_say(block):
    texts = [(f"rules.md:{block.line}", block.text)]
    if block.text.startswith("# rejected"):
        with pytest.raises(RuleLoadError) as caught:
            load_rules_from_texts(texts)
        named = block.text.splitlines()[0].split("'")[1]
        assert named in str(caught.value)
    else:
        table = load_rules_from_texts(texts)
        assert table.rules


def test_the_rules_guide_has_examples():
    assert len(RULE_BLOCKS) >= 6
    assert any(b.text.startswith("# rejected") for b in RULE_BLOCKS)


CONFIG_BLOCKS = [b for b in _yaml_blocks("deployment.md") if b.text.startswith("# gateway.yaml")]


@pytest.mark.parametrize("block", CONFIG_BLOCKS, ids=lambda b: f"deployment.md:{b.line}")
def test_config_file_examples_load(block, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(block.text)
    settings = load_settings({}, env={}, config_file=str(config))
    StoreConfig.from_mapping(settings.store, tmp_path)
    ControlPlaneConfig.from_mapping(settings.control_plane, tmp_path, {})


def test_the_deployment_guide_shows_regions_and_routes_configs(tmp_path):
    assert len(CONFIG_BLOCKS) >= 3
    loaded = []
    for i, block in enumerate(CONFIG_BLOCKS):
        config = tmp_path / f"{i}.yaml"
        config.write_text(block.text)
        loaded.append(load_settings({}, env={}, config_file=str(config)))
    regions = [s for s in loaded if s.regions]
    assert regions and {r.name for r in regions[0].regions} == {"us", "eu", "us2"}
    assert all(r.hosts and r.counter_url for r in regions[0].regions)
    assert any(s.routes for s in loaded)


def test_prometheus_alert_examples_parse_and_use_real_metrics():
    known = set(sample_index(metric_families()))
    alerts = [b for b in _yaml_blocks("deployment.md") if b.text.startswith("groups:")]
    assert alerts
    for block in alerts:
        for group in yaml.safe_load(block.text)["groups"]:
            for rule in group["rules"]:
                assert set(METRIC.findall(rule["expr"])) <= known, rule["expr"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_names_in_the_docs_are_real(doc):
    text = doc.read_text()
    unknown_env = set(ENV_NAME.findall(text)) - setting_env_names() - CLIENT_ENV - build_env_names()
    assert not unknown_env, f"{doc.name} names unknown variables {sorted(unknown_env)}"
    families = metric_families()
    known = set(sample_index(families)) | set(families)
    unknown_metrics = set(METRIC.findall(text)) - known
    assert not unknown_metrics, f"{doc.name} names unknown metrics {sorted(unknown_metrics)}"


def test_every_option_of_serve_is_documented():
    text = (ROOT / "docs" / "deployment.md").read_text()
    options = set(vars(build_parser().parse_args(["serve"]))) - {"func", "command"}
    undocumented = {
        name
        for name in options
        if f"`{name}`" not in text and f"--{name.replace('_', '-')}" not in text
    }
    assert not undocumented, f"docs/deployment.md does not mention {sorted(undocumented)}"


def test_docs_link_to_each_other_by_existing_anchors():
    def anchors(path: Path) -> set[str]:
        out = set()
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
                out.add(slug)
        return out

    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([a-z\-]*\.md)?#([a-z0-9\-]+)\)", doc.read_text()):
            linked = doc.parent / target if target else doc
            assert linked.is_file(), f"{doc.name} links to missing {target}"
            assert anchor in anchors(linked), (
                f"{doc.name} links to missing #{anchor} in {linked.name}"
            )
