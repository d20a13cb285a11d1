"""Prometheus config, alerts and the dashboard against a real server and a real Prometheus.

promtool checks the config and runs the alert unit tests; the dashboard's and the alerts' PromQL name
only series a running tokenizer-server exports; and a real `prometheus` scrapes that server, loads
the alerts, and answers every dashboard query with data, the request counters equal to the traffic sent.
Missing binaries skip, except under TOKENIZER_CI=1, where they fail.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sentencepiece as spm
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, free_port, read_documents, start_server, stop_server
from tests.test_deploy import dashboard_queries, metric_names, require_binary
from tokenizer_client import TokenizerClient
from tokenizer_service.settings import BUNDLED_MODELS_DIR

pytestmark = pytest.mark.slow  # a real Prometheus; part of .ci/run's slow stage

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
# Synthesized by Prometheus for every target, not exported by the server.
PROMETHEUS_SERIES = {"up"}
TOKENIZE_REQUESTS = 12
BATCH = 64


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"] if "alert" in rule
    ]


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


# promtool --------------------------------------------------------------------------------------


def test_promtool_checks_config_and_rules() -> None:
    config = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout


def test_promtool_alert_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    evaluations: dict[str, list[list[Any]]] = {}
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for evaluation in test.get("alert_rule_test", []):
            evaluations.setdefault(evaluation["alertname"], []).append(evaluation["exp_alerts"])
    for rule in alert_rules():
        expected = evaluations.get(rule["alert"], [])
        assert any(alerts for alerts in expected), f"no unit test expects {rule['alert']} to fire"
        assert any(not alerts for alerts in expected), f"no unit test expects {rule['alert']} to stay quiet"


def test_each_alert_unit_test_fails_when_its_alert_cannot_fire(tmp_path: Path) -> None:
    """The unit tests really test the alerts: break one alert's expression and its test must fail."""
    require_binary("promtool")
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    for rule in alert_rules():
        groups = yaml.safe_load(ALERTS.read_text())
        for candidate in (r for group in groups["groups"] for r in group["rules"]):
            if candidate.get("alert") == rule["alert"]:
                candidate["expr"] = "vector(1) < 0"
        (tmp_path / ALERTS.name).write_text(yaml.safe_dump(groups))
        result = promtool("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
        assert result.returncode != 0, f"the unit tests pass with {rule['alert']} unable to fire"
        assert rule["alert"] in result.stdout + result.stderr


# A real server with real traffic ---------------------------------------------------------------


@dataclass
class Observed:
    """A tokenizer-server on the bundled model, and the traffic sent to it."""

    url: str
    tokenize_requests: int = 0
    texts: int = 0
    tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


def drive_traffic(observed: Observed) -> None:
    """Tokenize, detokenize and pack real text, plus two refused requests, counting what /metrics should."""
    processor = spm.SentencePieceProcessor(model_file=str(BUNDLED_MODELS_DIR / "default.model"))
    documents = read_documents()
    with TokenizerClient(observed.url) as client:
        for request in range(TOKENIZE_REQUESTS):
            texts = documents[request * BATCH : (request + 1) * BATCH]
            rows = client.tokenize(texts)
            assert [row.tolist() for row in rows] == processor.encode(texts)
            observed.tokenize_requests += 1
            observed.texts += len(texts)
            observed.tokens += sum(len(row) for row in rows)
        decoded = client.detokenize(rows)
        observed.texts += len(decoded)
        observed.tokens += sum(len(row) for row in rows)
    for strategy in ("concat", "best_fit"):
        texts = documents[:BATCH]
        body = {"texts": texts, "seq_len": 256, "strategy": strategy, "add_eos": True}
        response = httpx.post(f"{observed.url}/v1/pack", json=body, timeout=30)
        assert response.status_code == 200, response.text
        observed.texts += len(texts)
        observed.tokens += sum(len(ids) for ids in processor.encode(texts, add_eos=True))
    for body, status in (({"texts": "not a list"}, "422"), ({"texts": ["x"], "model": "absent"}, "404")):
        assert httpx.post(f"{observed.url}/v1/tokenize", json=body, timeout=30).status_code == int(status)
        observed.statuses[status] = observed.statuses.get(status, 0) + 1


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    log = tmp_path_factory.mktemp("observed") / "server.log"
    url, process = start_server(["--workers", "2"], log)
    try:
        observed = Observed(url)
        drive_traffic(observed)
        yield observed
    finally:
        stop_server(process)


SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported_names(url: str) -> tuple[set[str], set[str]]:
    """Every series name the server's /metrics declares, and those of them with no sample yet.

    A labelled counter has no sample before its first event (no rejection yet, say), but its
    `# TYPE` line says what it will be called.
    """
    declared: set[str] = set()
    silent: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        names = {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
        declared |= names | {sample.name for sample in family.samples}
        if not family.samples:
            silent |= names
    return declared, silent


def exported_series(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> labels -> value, from the server's /metrics."""
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            series.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return series


def test_dashboard_and_alerts_name_only_exported_series(observed: Observed) -> None:
    declared, _ = exported_names(observed.url)
    exported = declared | PROMETHEUS_SERIES
    queries = [*dashboard_queries(), *((f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules())]
    for where, expr in queries:
        missing = metric_names(expr) - exported
        assert not missing, f"{where} queries {sorted(missing)}, which the server does not export"


def test_metrics_count_the_traffic(observed: Observed) -> None:
    series = exported_series(observed.url)
    tokenize_ok = (("endpoint", "/v1/tokenize"), ("status", "200"))
    assert series["tokenizer_requests_total"][tokenize_ok] == observed.tokenize_requests
    for status, count in observed.statuses.items():
        assert sum(v for k, v in series["tokenizer_requests_total"].items() if ("status", status) in k) == count
    assert series["tokenizer_request_duration_seconds_count"][(("endpoint", "/v1/tokenize"),)] == (
        observed.tokenize_requests + sum(observed.statuses.values())
    )
    assert series["tokenizer_texts_total"][(("model", "default"),)] == observed.texts
    assert series["tokenizer_tokens_total"][(("model", "default"),)] == observed.tokens
    assert series["tokenizer_pack_padding_ratio_count"][()] == 2
    assert series["tokenizer_workers"][()] == 2
    assert series["tokenizer_worker_seconds_total"][(("model", "default"),)] > 0


# A real Prometheus -----------------------------------------------------------------------------


@dataclass
class PrometheusServer:
    url: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
        return list(body["data"]["result"])


def prometheus_config(directory: Path, target: str) -> Path:
    """deploy/prometheus/prometheus.yml and its rules, pointed at `target` and scraping every second."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    for rule_file in config["rule_files"]:
        shutil.copy(PROMETHEUS_DIR / rule_file, directory / rule_file)
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def wait_for(condition: Any, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def prometheus(observed: Observed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    binary = require_binary("prometheus")
    directory = tmp_path_factory.mktemp("prometheus")
    config = prometheus_config(directory, observed.url.removeprefix("http://"))
    port = free_port()
    log = directory / "prometheus.log"
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=directory)
    server = PrometheusServer(f"http://127.0.0.1:{port}")

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited with {process.returncode}:\n{log.read_text()}")
        try:
            return httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, 30, "prometheus to start", log)
        # rate() needs two samples of each series: wait for three scrapes of the driven traffic.
        wait_for(
            lambda: server.query('count_over_time(tokenizer_workers{job="tokenizer"}[1m]) >= 3'),
            30,
            "three scrapes",
            log,
        )
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_prometheus_scrapes_the_request_counters(prometheus: PrometheusServer, observed: Observed) -> None:
    (up,) = prometheus.query('up{job="tokenizer"}')
    assert up["value"][1] == "1"
    (requests,) = prometheus.query('tokenizer_requests_total{job="tokenizer", endpoint="/v1/tokenize", status="200"}')
    assert float(requests["value"][1]) == observed.tokenize_requests
    (tokens,) = prometheus.query('sum(tokenizer_tokens_total{job="tokenizer"})')
    assert float(tokens["value"][1]) == observed.tokens
    refused = prometheus.query('sum by (status) (tokenizer_requests_total{job="tokenizer", status=~"4.."})')
    assert {row["metric"]["status"]: float(row["value"][1]) for row in refused} == observed.statuses


def test_prometheus_answers_every_dashboard_query_with_data(prometheus: PrometheusServer, observed: Observed) -> None:
    """Every panel shows data, except those reading only series whose first event has not happened."""
    _, silent = exported_names(observed.url)
    variables = {"$__rate_interval": "1m", "$__range": "5m", "$job": "tokenizer", "$instance": ".+"}
    for where, expr in dashboard_queries(variables):
        assert prometheus.query(expr) or metric_names(expr) <= silent, f"{where} has no data: {expr}"


def test_prometheus_loads_the_alerts_and_none_fires_on_a_healthy_server(prometheus: PrometheusServer) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if rules and all(rule["health"] == "ok" for rule in rules) else []

    deadline = time.monotonic() + 15
    while not (rules := evaluated()) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert rules, "the alert rules were not all evaluated healthy"
    assert {rule["name"] for rule in rules} == {rule["alert"] for rule in alert_rules()}
    assert [rule["name"] for rule in rules if rule["state"] == "firing"] == []
