"""examples/grafana/vllm-pd.json queries only metrics that exist.

Every metric name in the dashboard's PromQL must be a sample name the proxy's
/metrics exposes (a proxy on mock backends, scraped here), one vLLM 0.32
declares (read from vLLM's source, vllm/v1/metrics/loggers.py, without
importing vLLM), or one of our connector's gauges.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.router_harness import harness, run
from vllm_pd.connector.worker.transfer_counters import GAUGES

DASHBOARD = Path(__file__).resolve().parents[3] / "examples" / "grafana" / "vllm-pd.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")  # not a duration's unit (5m)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels, strings or ranges)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings, e.g. label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = _GROUPING.sub("", expr)  # label lists of by (...), on (...)
    return {
        m.group(1)
        for m in _IDENT.finditer(expr)
        if not m.group(2) and not re.fullmatch(r"(?:inf|nan|offset|bool|and|or|unless)", m.group(1), re.I)
    }


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _samples(name: str, kind: str) -> set[str]:
    return {name + s for s in _SUFFIXES.get(kind, ("",))}


def proxy_metric_names() -> set[str]:
    async def scrape() -> str:
        async with harness() as h:
            async with h.session.get(h.url + "/metrics") as r:
                return await r.text()

    text = run(scrape)
    return {n for fam in text_string_to_metric_families(text) for n in _samples(fam.name, fam.type)}


def vllm_metric_names() -> set[str]:
    spec = importlib.util.find_spec("vllm")  # the package's location only: vLLM is not imported
    assert spec is not None and spec.submodule_search_locations
    source = (Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py").read_text()
    declared = re.findall(r"_(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[A-Za-z0-9_:]+)\"", source)
    assert len(declared) > 20, "vLLM's metric declarations were not found; did loggers.py change?"
    names = {n for kind, name in declared for n in _samples(name, kind)}
    return names | {f"vllm:pd_{g}" for g in GAUGES}  # our connector's gauges, in vLLM's /metrics


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, backend) (rate(vllm_pd_proxy_prefill_seconds_bucket"
        '{job=~"a|b", le!="+Inf"}[$__rate_interval]))) / on (instance) vllm:num_requests_running offset 5m'
    )
    assert metric_names(expr) == {"vllm_pd_proxy_prefill_seconds_bucket", "vllm:num_requests_running"}


def test_every_dashboard_metric_exists() -> None:
    exprs = dashboard_exprs()
    queried = set().union(*(metric_names(e) for e in exprs))
    assert any(n.startswith("vllm_pd_proxy_") for n in queried) and any(n.startswith("vllm:") for n in queried)
    known = proxy_metric_names() | vllm_metric_names()
    assert "vllm_pd_proxy_no_such_metric" not in known
    missing = sorted(queried - known)
    assert not missing, f"the dashboard queries metrics nobody exposes: {missing}"
