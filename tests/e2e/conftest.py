"""Real vLLM servers, in phases (see tests/support/e2e_cluster.py): a plain instance's reference
answers, then the session's connector pair. Session-scoped: each starts once per test session.
The ``small_model_dir`` fixture they build on is in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support import reference_margins
from tests.support.prompt_catalogue import CATALOGUE

# run before the session's connector pair starts: the TP=2 tests start four model workers, and
# on two cores they should not share them with two more idle servers that live all session
FIRST_MODULES = ("tests.e2e.test_connector_tp_e2e", "tests.e2e.test_connector_multi_e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: getattr(item.module, "__name__", "") not in FIRST_MODULES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing end-to-end test's report carries what the servers' logs said (CI keeps nothing else)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("e2e") is not None and ec.LIVE:
        report.sections.append(("vLLM servers' logs", ec.live_log_digest()))


def _running_cluster() -> list[dict] | None:
    """Developer loop: VLLM_PD_TEST_CLUSTER=file.json names already running servers
    ([plain, pd0, pd1] as {"url", "kv"}), so e2e tests run without starting any."""
    import json
    import os

    path = os.environ.get("VLLM_PD_TEST_CLUSTER")
    return json.loads(Path(path).read_text()) if path else None


class _External:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture(scope="session")
def reference_outputs(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy output token ids of a plain instance (no connector) for every catalogue entry.

    Runs alone and is stopped before the disaggregated instances start."""
    running = _running_cluster()
    if running:
        with httpx.Client() as client:
            return _reference_answers(client, running[0]["url"])
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    [plain] = ec.start_all([(ec.server_spec(small_model_dir, "0-1", None), None)], log_dir)
    try:
        with httpx.Client() as client:
            return _reference_answers(client, plain.url)
    finally:
        ec.stop_all([plain])


def _reference_answers(client: httpx.Client, url: str) -> dict[str, list[int]]:
    """Every catalogue entry's answer; how sure each step was goes to reference_margins.MARGINS."""
    out = {}
    for key, body in CATALOGUE.items():
        resp = ec.post(client, url, reference_margins.with_top2(body))
        out[key] = ec.output_tokens(resp)
        reference_margins.MARGINS[key] = reference_margins.top2_margins(resp)
    return out


@pytest.fixture(scope="session")
def pd_pair(reference_outputs: dict[str, list[int]], small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two kv_both instances with the connector: [0] on core 0, [1] on core 1; their KV connections
    authenticate with a deployment secret (VLLM_PD_TEST_SECRET=0: without one, on loopback; the TP,
    store and router suites run that way)."""
    import os

    running = _running_cluster()
    if running:
        yield [
            ec.Instance(_External(r["url"]), r["kv"], r.get("secret_file"))  # type: ignore[arg-type]
            for r in running[1:]
        ]
        return
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    secret = {} if os.environ.get("VLLM_PD_TEST_SECRET") == "0" else {"secret_file": ec.write_secret(log_dir)}
    specs = []
    for cores in ("0", "1"):
        kv_port = ec.free_port()
        ktc = ec.connector_config("kv_both", kv_port, lease_s=20.0, **secret)
        specs.append((ec.server_spec(small_model_dir, cores, ktc), kv_port))
    instances = ec.start_all(specs, log_dir)
    yield instances
    ec.stop_all(instances)
