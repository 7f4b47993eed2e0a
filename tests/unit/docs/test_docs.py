"""The documentation site: it builds strictly, offline, and its reference covers the code.

* The build itself (``mkdocs build --strict``, a process of its own) is in
  tests/integration/test_docs_site.py; here: mkdocs.yml fetches nothing (no web fonts, no plugins
  that download).
* The generated reference (docs/hooks/reference_pages.py) has an entry, with a meaning, for every
  setting, YAML key, CLI flag and metric the code defines. The names the code defines are read
  here independently of the generator: the config dataclasses' fields, the argparse parsers'
  actions, the metrics as Prometheus exposes them (the proxy's registry rendered; the connector's
  registered on a registry of real prometheus_client metrics).
* Every metric name the code or the hand-written docs mention exists, so prose cannot name a
  metric that is gone.
* The README stays a front page: at most 150 lines, CI's command verbatim, links into docs/ that exist.

Negative controls: a dataclass field without a comment, a flag without help and a reference with an
entry removed are each reported by the same checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))

import reference_pages  # noqa: E402 - docs/hooks is not a package

CI_COMMAND = (
    "bash install.sh && ruff check vllm_pd tests benchmarks docs/hooks"
    " && ruff format --check vllm_pd tests benchmarks docs/hooks && mypy && python3 -m pytest -q tests"
)


def test_mkdocs_config_fetches_nothing() -> None:
    """Material's web fonts are off and no plugin that downloads (social cards, privacy) is on."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+font: false", text, re.M)
    for plugin in ("social", "privacy", "optimize", "git-revision", "git-committers"):
        assert not re.search(rf"^\s+- {plugin}\b", text, re.M), plugin


# ---- what the code defines, read independently of the generator ---------------------------------


def code_settings() -> dict[str, set[str]]:
    """Source -> the names the code accepts: config fields (those a user sets) and renamed keys."""
    from vllm_pd.connector.config import PDConnectorConfig
    from vllm_pd.connector.store.config import StoreConfig
    from vllm_pd.router.config import _FIELD_TYPES, InstanceConfig, K8sDiscoveryConfig

    return {
        "connector": {f.name for f in dataclasses.fields(PDConnectorConfig) if not f.metadata.get("loaded")},
        "store": {f"store.{f.name}" for f in dataclasses.fields(StoreConfig) if not f.metadata.get("connector")},
        "proxy": set(_FIELD_TYPES),  # what config_from_mapping accepts besides instances and kubernetes
        "instances": {f"instances[].{f.name}" for f in dataclasses.fields(InstanceConfig)},
        "kubernetes": {f"kubernetes.{f.name}" for f in dataclasses.fields(K8sDiscoveryConfig)},
    }


def code_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string (and positional) of a parser, help excluded."""
    out = set()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        out.update(action.option_strings or [action.metavar if isinstance(action.metavar, str) else action.dest])
    return out


def code_cli() -> dict[str, set[str]]:
    from vllm_pd.cli import build_parser

    parser = build_parser()
    out = {"vllm-pd": code_flags(parser)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({f"vllm-pd {name}": code_flags(sub) for name, sub in action.choices.items()})
    return out


def exposed_metrics(text: str) -> set[str]:
    """Metric names in a Prometheus exposition (``# TYPE`` lines; the ``_created`` companions left out)."""
    return {
        name
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
        if not (name.endswith("_created") and kind == "gauge")
    }


def code_metrics() -> set[str]:
    import prometheus_client
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_pd.connector.stats import PDPromMetrics
    from vllm_pd.router.config import ProxyConfig
    from vllm_pd.router.observability.metrics import ProxyMetrics
    from vllm_pd.router.pool.instance_pool import InstancePool

    proxy = exposed_metrics(ProxyMetrics(InstancePool(ProxyConfig())).render().decode())
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:  # a real prometheus_client metric class registering on our registry
        return type(
            cls.__name__,
            (cls,),
            {
                "__init__": lambda self, *a, **k: cls.__init__(
                    self, *a, registry=registry, **{key: v for key, v in k.items() if key != "multiprocess_mode"}
                )
            },
        )

    types = {
        prometheus_client.Counter: bound(prometheus_client.Counter),
        prometheus_client.Gauge: bound(prometheus_client.Gauge),
        prometheus_client.Histogram: bound(prometheus_client.Histogram),
    }
    labels = list(reference_pages.VLLM_LABELS)
    PDPromMetrics(SimpleNamespace(kv_transfer_config=None), types, labels, {0: ["m", "0"]})
    connector = exposed_metrics(generate_latest(registry).decode())
    assert proxy and connector
    return proxy | connector


# ---- the checks (functions, so the negative controls run them on altered input) ------------------


def missing(documented: list[reference_pages.Entry], defined: set[str]) -> list[str]:
    """What the code defines without a reference entry, and entries without a meaning."""
    names = {e.name for e in documented}
    flag_names = {part.strip() for e in documented for part in e.name.split(",")}
    out = [f"no entry: {n}" for n in sorted(defined) if n not in names and n not in flag_names]
    out += [f"no meaning: {e.name}" for e in documented if not e.meaning.strip()]
    return out


def test_reference_covers_every_setting() -> None:
    entries = reference_pages.all_entries()
    for source, defined in code_settings().items():
        assert not missing(entries[source], defined), (source, missing(entries[source], defined))
    # and nothing documented that the code does not accept
    for source, defined in code_settings().items():
        assert {e.name for e in entries[source]} <= defined, source


def test_reference_covers_every_cli_flag() -> None:
    entries = reference_pages.all_entries()
    for command, flags in code_cli().items():
        documented = entries[f"cli: {command}"]
        assert not missing(documented, flags), (command, missing(documented, flags))


def test_reference_covers_every_metric() -> None:
    documented = reference_pages.all_entries()["metrics"]
    defined = code_metrics()
    assert not missing(documented, defined), missing(documented, defined)
    assert {e.name for e in documented} == defined


_METRIC_NAME = re.compile(r"(vllm_pd_proxy_[a-z0-9_]*[a-z0-9]|vllm:pd_[a-z0-9_]*[a-z0-9])")


def metric_mentions(text: str) -> set[str]:
    """Full metric names a text mentions (a sample's suffix dropped: ``_bucket``, ``_sum``, ``_count``)."""
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in _METRIC_NAME.findall(text)}


def test_every_metric_mentioned_exists() -> None:
    """The code's strings and docstrings, the hand-written docs and the README name only real metrics."""
    defined = {e.name for e in reference_pages.all_entries()["metrics"]}
    known = defined | {n.removesuffix("_total") for n in defined}
    texts = {
        p: p.read_text()
        for p in [*(ROOT / "vllm_pd").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
        if "benchmarks" not in p.parts
    }
    unknown = {
        f"{p.relative_to(ROOT)}: {m}"
        for p, text in texts.items()
        for m in metric_mentions(text)
        if m not in known and not m.endswith("_")
    }
    assert not unknown, sorted(unknown)


# ---- negative controls -------------------------------------------------------------------------


def test_a_setting_without_a_comment_is_reported() -> None:
    from vllm_pd.connector.config import PDConnectorConfig

    @dataclasses.dataclass(frozen=True)
    class Grown(PDConnectorConfig):
        brand_new_knob: int = 3

    entries = reference_pages.dataclass_entries(Grown)
    defined = {f.name for f in dataclasses.fields(Grown) if not f.metadata.get("loaded")}
    assert "no meaning: brand_new_knob" in missing(entries, defined)


def test_a_flag_without_help_is_reported() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented", help="it says what it does")
    parser.add_argument("--silent")
    entries = [e for _, e in reference_pages._action_entries(parser)]
    assert missing(entries, code_flags(parser)) == ["no meaning: --silent"]


def test_a_dropped_entry_is_reported() -> None:
    documented = reference_pages.all_entries()["metrics"]
    assert missing(documented[1:], code_metrics()) == [f"no entry: {documented[0].name}"]


def test_an_unknown_metric_mention_is_found() -> None:
    assert metric_mentions("see `vllm:pd_loads_total` and vllm_pd_proxy_gone_seconds_bucket") == {
        "vllm:pd_loads_total",
        "vllm_pd_proxy_gone_seconds",
    }


def test_no_key_of_the_building_machine_lands_in_a_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--api-key`` and others default to a VLLM_PD_* variable; the pages are generated without them."""
    from vllm_pd.cli import build_parser

    key = "do-not-publish-0123456789abcdef"
    for name in ("VLLM_PD_API_KEY", "VLLM_PD_BACKEND_API_KEY", "VLLM_PD_ADMIN_TOKEN"):
        monkeypatch.setenv(name, key)
    assert key in repr(build_parser()._subparsers._group_actions[0].choices["proxy"]._actions)  # control
    assert not any(key in text for text in reference_pages.generate().values())
    assert os.environ["VLLM_PD_API_KEY"] == key  # put back


# ---- the README --------------------------------------------------------------------------------


def test_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert CI_COMMAND in text  # .ci/run runs exactly this
    assert "bash install.sh && vllm-pd up" in text
    links = re.findall(r"\]\((?!https?://)([^)#]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


@pytest.mark.parametrize("page", sorted(reference_pages.PAGES.values()))
def test_generated_pages_are_not_committed(page: str) -> None:
    """A generated page lives only in the built site: a committed copy could drift."""
    assert not (ROOT / "docs" / page).exists()
