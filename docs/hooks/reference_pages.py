"""The reference pages, generated from the code: settings, proxy configuration, CLI, metrics.

Each page is read out of the code that defines what it documents, so it cannot drift:

* connector and store settings: the fields of ``PDConnectorConfig`` and ``StoreConfig``, with the
  comments written beside each field as its meaning;
* the proxy's YAML keys: the fields of ``ProxyConfig``, ``InstanceConfig`` and
  ``K8sDiscoveryConfig`` (meaning: the field's comment, else its flag's help);
* the CLI: ``vllm_pd.cli.build_parser()``, every subcommand, every flag with its help;
* metrics: the proxy's registry (``ProxyMetrics``) and the connector's Prometheus metrics
  (``PDPromMetrics``, instantiated with recording metric classes), with their help texts.

``generate()`` returns ``{page path: markdown}``; the mkdocs hook (``docs/hooks/reference.py``)
adds those pages to the site at build time, ``tests/unit/docs/test_docs.py`` checks that they cover every
setting, flag and metric the code defines, and ``python docs/hooks/reference_pages.py OUT`` writes
them to OUT to read without a build. Only the standard library, the package and what it imports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import re
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFERENCE_DIR = "reference"
PAGES = {
    "connector": f"{REFERENCE_DIR}/connector-settings.md",
    "proxy": f"{REFERENCE_DIR}/proxy-config.md",
    "cli": f"{REFERENCE_DIR}/cli.md",
    "metrics": f"{REFERENCE_DIR}/metrics.md",
}
GENERATED_NOTE = (
    "<!-- generated at build time by docs/hooks/reference_pages.py from the code; "
    "edit the code's comments and help texts, not this page -->"
)


@dataclass(frozen=True)
class Entry:
    """One documented item: a setting, a flag or a metric."""

    name: str  # the key (``store.cpu_bytes``), flag (``--port``) or metric name as exposed
    kind: str  # its type, or the metric's type
    default: str  # "" where none applies
    meaning: str  # from the code's comment / help text / metric help; "" = missing (a test fails)
    extra: str = ""  # the flag of a YAML key, a metric's labels, a renamed key's old name


# ---- reading the code --------------------------------------------------------------------------


def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's field comments: the comment lines right above a field plus the one after it."""
    lines, _ = inspect.getsourcelines(cls)
    comments: dict[str, str] = {}
    pending: list[str] = []
    field_re = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*:\s*[^=#]+?(?:=.*?)?(?:#\s*(.*))?$")
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        if not stripped or stripped.startswith(('"""', "def ", "@")):
            pending = []
            if stripped.startswith(("def ", "@")):
                break  # the fields come first
            continue
        m = field_re.match(line.rstrip())
        if m is None:
            pending = []
            continue
        trailing = (m.group(2) or "").strip()
        text = " ".join([*pending, trailing]).strip()
        comments[m.group(1)] = text
        pending = []
    return comments


def render_type(tp: Any) -> str:
    """A type as a reader wants it: a Literal's choices, ``X | None`` as X."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return render_type(rest[0]) if len(rest) == 1 else " or ".join(render_type(a) for a in rest)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return "list"
    if origin is dict or tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def render_default(name: str, value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024:
        for unit, shift in (("g", 30), ("m", 20), ("k", 10)):
            if value % (1 << shift) == 0:
                return f"`{value >> shift}{unit}`"
    if isinstance(value, (list, tuple)) and not value:
        return "none"
    return f"`{value}`"


def dataclass_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def dataclass_entries(
    cls: type,
    prefix: str = "",
    skip: frozenset[str] = frozenset(),
    meanings: dict[str, str] | None = None,
    required: frozenset[str] = frozenset(),
) -> list[Entry]:
    """One entry per field of ``cls`` (those in ``skip`` left out); meaning: its comment, else ``meanings``."""
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meaning = comments.get(f.name) or (meanings or {}).get(f.name, "")
        default = "required" if f.name in required else render_default(f.name, dataclass_default(f))
        out.append(Entry(prefix + f.name, render_type(hints[f.name]), default, meaning))
    return out


# ---- connector settings ------------------------------------------------------------------------


def connector_entries() -> list[Entry]:
    from vllm_pd.connector.config import PDConnectorConfig

    loaded = frozenset(f.name for f in dataclasses.fields(PDConnectorConfig) if f.metadata.get("loaded"))
    return [with_sizes(e) for e in dataclass_entries(PDConnectorConfig, skip=loaded)]


def with_sizes(e: Entry) -> Entry:
    """The connector's and the store's ``*_bytes`` keys take sizes (``parse_size``: ``512m``, ``4g``)."""
    return dataclasses.replace(e, kind="size") if e.name.endswith("_bytes") else e


def store_entries() -> list[Entry]:
    from vllm_pd.connector.store import config as store_config

    cls = store_config.StoreConfig
    own = frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("connector"))
    renamed_to = {new: old for old, new in store_config._RENAMED.items()}
    return [
        dataclasses.replace(
            with_sizes(e), extra=f"old name: `store.{renamed_to[e.name[6:]]}`" if e.name[6:] in renamed_to else ""
        )
        for e in dataclass_entries(cls, prefix="store.", skip=own)
    ]


def connector_page() -> str:
    rows = [
        GENERATED_NOTE,
        "# Connector settings",
        "",
        "Every key of the connector's `kv_connector_extra_config` (`PDConnectorConfig`, "
        "`vllm_pd/connector/config.py`) and of its `store` object (`StoreConfig`, "
        "`vllm_pd/connector/store/config.py`). Sizes take an integer of bytes or a string such as "
        "`512m`, `4g`. An unknown key or a bad value stops vLLM at start-up with a message naming the key. "
        "How the settings work together: [the connector guide](../guides/connector.md) and "
        "[the store guide](../guides/store.md).",
        "",
        "## `kv_connector_extra_config`",
        "",
    ]
    rows += table(connector_entries(), ("key", "type", "default", "meaning"))
    rows += [
        "",
        "## `kv_connector_extra_config.store`",
        "",
        "Present = a KV store in every worker of the instance; absent = no store.",
        "",
    ]
    rows += table(store_entries(), ("key", "type", "default", "meaning", "note"))
    return "\n".join(rows) + "\n"


# ---- the proxy's configuration -----------------------------------------------------------------

# K8sDiscoveryConfig field -> the flag that sets it (command_proxy._kubernetes_from_args)
_K8S_FLAGS = {
    "namespace": "--k8s-namespace",
    "api_url": "--k8s-api-url",
    "http_port": "--k8s-port",
    "prefill_selector": "--prefill-selector",
    "decode_selector": "--decode-selector",
    "both_selector": "--both-selector",
}


@contextlib.contextmanager
def _no_deployment_env() -> Iterator[None]:
    """Parsers built without the builder's VLLM_PD_* variables: some flags default to one (``--api-key``
    to VLLM_PD_API_KEY), and a key of the machine that builds the docs must never land in a page."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("VLLM_PD_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    from vllm_pd.cli import build_parser as cli_parser

    with _no_deployment_env():
        return cli_parser()


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("vllm_pd.cli.build_parser() has no subcommands")


def flag_of(parser: argparse.ArgumentParser, dest: str) -> argparse.Action | None:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return action
    return None


def proxy_entries() -> list[Entry]:
    from vllm_pd.router import config as proxy_config

    proxy = subcommand_parsers()["proxy"]
    loaded = frozenset(f.name for f in dataclasses.fields(proxy_config.ProxyConfig) if not f.init)
    out = []
    for e in dataclass_entries(proxy_config.ProxyConfig, skip=loaded | {"instances", "kubernetes"}):
        action = flag_of(proxy, e.name)
        meaning = e.meaning or (action.help or "" if action else "")
        flag = "/".join(f"`{s}`" for s in action.option_strings) if action else "YAML only"
        kind = " \\| ".join(f"`{c}`" for c in action.choices) if action and action.choices else e.kind
        out.append(dataclasses.replace(e, kind=kind, meaning=meaning, extra=flag))
    return out


def instance_entries() -> list[Entry]:
    from vllm_pd.router.config import InstanceConfig

    return dataclass_entries(InstanceConfig, prefix="instances[].", required=frozenset({"url", "role"}))


def kubernetes_entries() -> list[Entry]:
    from vllm_pd.router.config import K8sDiscoveryConfig

    proxy = subcommand_parsers()["proxy"]
    out = []
    for e in dataclass_entries(K8sDiscoveryConfig, prefix="kubernetes."):
        field_name = e.name.removeprefix("kubernetes.")
        action = (
            flag_of(proxy, _K8S_FLAGS[field_name].lstrip("-").replace("-", "_")) if field_name in _K8S_FLAGS else None
        )
        meaning = e.meaning or (action.help or "" if action else "")
        out.append(
            dataclasses.replace(
                e, meaning=meaning, extra=f"`{_K8S_FLAGS[field_name]}`" if field_name in _K8S_FLAGS else "YAML only"
            )
        )
    return out


def proxy_page() -> str:
    rows = [
        GENERATED_NOTE,
        "# Proxy configuration",
        "",
        "`vllm-pd proxy` takes its settings from flags, a YAML file (`--config FILE`, the keys below; a flag "
        "given overrides the file) or both (`ProxyConfig`, `vllm_pd/router/config.py`). An unknown key or a bad "
        "value stops start-up with a message naming the key. An example file: `examples/router/proxy.yaml`; "
        "the guide: [the PD proxy](../guides/proxy.md). Every flag, including those with no YAML key "
        "(`--prefill`, `--decode`, `--kv-events`, ...): [CLI](cli.md#vllm-pd-proxy).",
        "",
        "## Top-level keys",
        "",
    ]
    rows += table(proxy_entries(), ("key", "type", "default", "meaning", "flag"))
    rows += [
        "",
        "## `instances`",
        "",
        "A list of mappings, one per vLLM instance (the flags `--prefill`, `--decode URL[@KV]` and "
        "`--both URL[@KV]` add to it).",
        "",
    ]
    rows += table(instance_entries(), ("key", "type", "default", "meaning"))
    rows += [
        "",
        "## `kubernetes`",
        "",
        "Instances found in Kubernetes: the pods of one label selector per role, watched "
        "([Kubernetes guide](../guides/kubernetes.md)). Present = `--service-discovery k8s`.",
        "",
    ]
    rows += table(kubernetes_entries(), ("key", "type", "default", "meaning", "flag"))
    return "\n".join(rows) + "\n"


# ---- the CLI -----------------------------------------------------------------------------------


def _action_entries(parser: argparse.ArgumentParser) -> Iterator[tuple[str, Entry]]:
    """(group title, entry) per argument of ``parser``, help excluded, in the parser's order."""
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            metavar = action.metavar if isinstance(action.metavar, str) else None
            name = ", ".join(action.option_strings) if action.option_strings else (metavar or action.dest)
            if action.choices is not None:
                value = " \\| ".join(f"`{c}`" for c in action.choices)
            elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                value = "switch"
            elif action.nargs == 0:
                value = "switch"
            else:
                value = f"`{metavar or action.dest.upper()}`"
                if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
                    value += " (repeatable)" if action.option_strings else " ..."
            default = action.default
            unset = default is None or default is False or default == [] or default == argparse.SUPPRESS
            shown = (
                "" if unset or isinstance(action, argparse._StoreFalseAction) else render_default("", _plain(default))
            )
            yield group.title or "", Entry(name, value, shown, (action.help or "").replace("%%", "%"))


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return value


_GROUP_TITLES = {"positional arguments": "Arguments", "options": "Options", "optional arguments": "Options"}


def cli_entries() -> dict[str, list[Entry]]:
    """Command (``vllm-pd``, ``vllm-pd proxy``, ...) -> its arguments."""
    out = {"vllm-pd": [e for _, e in _action_entries(build_parser())]}
    for name, parser in subcommand_parsers().items():
        out[f"vllm-pd {name}"] = [e for _, e in _action_entries(parser)]
    return out


def cli_page() -> str:
    from vllm_pd.cli import SUBCOMMANDS

    rows = [
        GENERATED_NOTE,
        "# CLI: `vllm-pd`",
        "",
        "One command, one subcommand per job (`vllm_pd/cli.py`; each subcommand's module defines its flags). "
        "`vllm-pd SUBCOMMAND --help` prints the same.",
        "",
        "| subcommand | what it does |",
        "|---|---|",
    ]
    rows += [f"| [`{name}`](#vllm-pd-{name}) | {help_text} |" for name, (_, help_text) in SUBCOMMANDS.items()]
    rows += ["", "## `vllm-pd`", "", "Options before the subcommand:", ""]
    rows += table([e for _, e in _action_entries(build_parser())], ("argument", "value", "default", "meaning"))
    for name, parser in subcommand_parsers().items():
        module = SUBCOMMANDS[name][0]
        rows += ["", f"## `vllm-pd {name}` {{#vllm-pd-{name}}}", "", f"{parser.description} (`{module}`)", ""]
        groups: dict[str, list[Entry]] = {}
        for title, entry in _action_entries(parser):
            groups.setdefault(title, []).append(entry)
        for title, entries in groups.items():
            rows += ["", f"**{_GROUP_TITLES.get(title, title)}**", ""]
            rows += table(entries, ("argument", "value", "default", "meaning"))
    return "\n".join(rows) + "\n"


# ---- metrics -----------------------------------------------------------------------------------

# labels vLLM gives every connector metric (vllm/v1/metrics/loggers.py: model name and engine index)
VLLM_LABELS = ["model_name", "engine"]


def proxy_metric_entries() -> list[Entry]:
    from prometheus_client.metrics import MetricWrapperBase

    from vllm_pd.router.config import ProxyConfig
    from vllm_pd.router.observability.metrics import ProxyMetrics
    from vllm_pd.router.pool.instance_pool import InstancePool

    metrics = ProxyMetrics(InstancePool(ProxyConfig()))
    out = []
    for collector in list(metrics.registry._collector_to_names):  # every registered collector
        if isinstance(collector, MetricWrapperBase):  # a prometheus_client Counter, Gauge, ...
            out.append(
                metric_entry(
                    collector._name, collector._type or "", collector._documentation, list(collector._labelnames)
                )
            )
            continue
        describe = getattr(collector, "describe", None)  # a custom collector: its families carry their labels
        for fam in describe() if describe is not None else collector.collect():
            out.append(metric_entry(fam.name, fam.type, fam.documentation, list(getattr(fam, "_labelnames", ()))))
    return sorted(out, key=lambda e: e.name)


def metric_entry(name: str, kind: str, documentation: str, labels: list[str]) -> Entry:
    exposed = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
    return Entry(exposed, kind, "", documentation, ", ".join(f"`{label}`" for label in labels))


class _RecordedMetric:
    """Stands in for vLLM's Prometheus metric classes: records what the connector registers."""

    kind = ""
    made: list[tuple[str, str, str, list[str]]] = []

    def __init__(self, name: str, documentation: str = "", labelnames: list[str] | None = None, **_: Any) -> None:
        _RecordedMetric.made.append((self.kind, name, documentation, list(labelnames or [])))


class _RecordedCounter(_RecordedMetric):
    kind = "counter"


class _RecordedGauge(_RecordedMetric):
    kind = "gauge"


class _RecordedHistogram(_RecordedMetric):
    kind = "histogram"


def connector_metric_entries() -> list[Entry]:
    from types import SimpleNamespace

    import prometheus_client

    from vllm_pd.connector.stats import PDPromMetrics

    _RecordedMetric.made = []
    types = {
        prometheus_client.Counter: _RecordedCounter,
        prometheus_client.Gauge: _RecordedGauge,
        prometheus_client.Histogram: _RecordedHistogram,
    }
    PDPromMetrics(SimpleNamespace(kv_transfer_config=None), types, list(VLLM_LABELS), {0: ["model", "0"]})
    out = [
        metric_entry(name, kind, doc, [label for label in labels if label not in VLLM_LABELS])
        for kind, name, doc, labels in _RecordedMetric.made
    ]
    return sorted(out, key=lambda e: e.name)


def metrics_page() -> str:
    rows = [
        GENERATED_NOTE,
        "# Metrics",
        "",
        "Counters are exposed with Prometheus' `_total` suffix, histograms as `_bucket`, `_sum` and `_count`.",
        "",
        "## The connector, in vLLM's `/metrics`",
        "",
        "Registered by `PDPromMetrics` (`vllm_pd/connector/stats.py`) through vLLM's KV connector stats: every "
        "sample also carries vLLM's own labels (`model_name`, `engine`). Gauges have one sample per TP rank "
        "(`tp_rank`): with TP > 1 every rank holds its own shard of a transfer's KV, so a rank that was never "
        "released shows on its own. vLLM also logs the counters (summed over ranks) in its periodic stats "
        "line.",
        "",
    ]
    rows += table(connector_metric_entries(), ("metric", "type", "meaning", "labels"), skip_default=True)
    rows += [
        "",
        "## The proxy, on its `/metrics`",
        "",
        "`vllm-pd proxy` has its own registry (`vllm_pd/router/observability/metrics.py`, the per-instance leg "
        "histograms in `vllm_pd/router/observability/leg_timings.py`). The vLLM instance a sample is about is the "
        "`backend` label (its "
        "URL); Prometheus' own `instance` label is the proxy. A Grafana dashboard of these beside vLLM's own "
        "metrics: `examples/grafana/vllm-pd.json`.",
        "",
    ]
    rows += table(proxy_metric_entries(), ("metric", "type", "meaning", "labels"), skip_default=True)
    rows += [
        "",
        "## The store master",
        "",
        "`vllm-pd store-master` exports no Prometheus metrics. Its `Stats` request "
        "(`MasterClient.stats()`, `vllm_pd/connector/store/master_client.py`) answers `nodes` (nodes "
        "publishing), `keys` (block keys indexed), `refused` (messages from peers that did not prove the "
        "deployment secret) and `sessions` (authenticated sessions open; the last two with a secret). The "
        "blocks store nodes serve each other are counted on the serving node: "
        "`vllm:pd_store_served_blocks_total`.",
        "",
    ]
    return "\n".join(rows) + "\n"


# ---- tables and the whole set ------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") if text else ""


def table(entries: list[Entry], header: tuple[str, ...], skip_default: bool = False) -> list[str]:
    rows = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    for e in entries:
        cells = [f"`{e.name}`", e.kind] + ([] if skip_default else [e.default]) + [_cell(e.meaning)]
        if len(header) > len(cells):
            cells.append(e.extra)
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def generate() -> dict[str, str]:
    """Page path (relative to docs/) -> markdown, for every generated reference page."""
    return {
        PAGES["connector"]: connector_page(),
        PAGES["proxy"]: proxy_page(),
        PAGES["cli"]: cli_page(),
        PAGES["metrics"]: metrics_page(),
    }


def all_entries() -> dict[str, list[Entry]]:
    """Every entry the pages hold, by source (what tests/unit/docs/test_docs.py checks)."""
    out = {
        "connector": connector_entries(),
        "store": store_entries(),
        "proxy": proxy_entries(),
        "instances": instance_entries(),
        "kubernetes": kubernetes_entries(),
        "metrics": connector_metric_entries() + proxy_metric_entries(),
    }
    for command, entries in cli_entries().items():
        out[f"cli: {command}"] = entries
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python docs/hooks/reference_pages.py OUT_DIR", file=sys.stderr)
        return 2
    for rel, text in generate().items():
        path = Path(argv[0]) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
