"""Deployment files agree with each other and with the server: Dockerfile, compose, Kubernetes, Grafana.

Validators that are binaries (hadolint, docker compose) skip when missing on a developer machine,
but fail under TOKENIZER_CI=1 (.ci/run), so CI never skips them silently.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from tests.conftest import ROOT, Server
from tokenizer_client.dataset import TokenDataset
from tokenizer_service.settings import BUNDLED_MODELS_DIR

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PODMONITOR = K8S / "prometheus-operator" / "podmonitor.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tokenizer.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
MODELS_DIR = "/models"
PORT = 8000
# Grafana's variables, as a query with every replica selected sees them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$job": ".+", "$instance": ".+"}


def require_binary(name: str) -> str:
    """The binary's path; skip when it is missing, except in CI (TOKENIZER_CI=1), where that fails."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("TOKENIZER_CI") == "1":
            pytest.fail(f"{name} is not installed, and TOKENIZER_CI=1 says this test must run")
        pytest.skip(f"{name} is not installed")
    return path


def run(command: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped.removesuffix("\\").strip() + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            keyword, _, arguments = pending.partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def k8s_resources() -> dict[str, dict[str, Any]]:
    """The manifests of deploy/k8s by kind (names are unique per kind there), headless Service and Jobs apart."""
    resources = {}
    for path in sorted(K8S.glob("*.yaml")):
        for document in load_documents(path):
            key = document["kind"]
            if key == "Job":
                key = f"Job/{document['metadata']['name']}"
            if key == "Service" and document["spec"].get("clusterIP") == "None":
                key = "HeadlessService"
            assert key not in resources, f"two {key} manifests"
            resources[key] = document
    return resources


def pod_spec() -> dict[str, Any]:
    return k8s_resources()["Deployment"]["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (only,) = pod_spec()["containers"]
    return only


def container_env() -> dict[str, Any]:
    """Name -> literal value, or the valueFrom reference."""
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container()["env"]}


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_binds(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (relative to the repository) of a compose service's bind mounts."""
    binds = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        binds[target] = source
    return binds


def image_user() -> str:
    return [arguments for keyword, arguments in dockerfile() if keyword == "USER"][-1]


def dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions((ROOT / "Dockerfile").read_text())


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def substitute_grafana_variables(expr: str, values: dict[str, str] | None = None) -> str:
    for name, value in sorted((values or GRAFANA_VARIABLES).items(), key=lambda item: -len(item[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable left in {expr!r}"
    return expr


def dashboard_queries(values: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable, Grafana variables filled in."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", substitute_grafana_variables(target["expr"], values)
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            matched = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert matched, f"variable {variable['name']}: {query!r} is not label_values(selector, label)"
            yield f"variable {variable['name']}", substitute_grafana_variables(matched[1], values)


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


# Dockerfile ------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    hadolint = require_binary("hadolint")
    result = run([hadolint, "Dockerfile"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multi_stage_from_base_image_and_unprivileged() -> None:
    instructions = dockerfile()
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    stages = [arguments for keyword, arguments in instructions if keyword == "FROM"]
    assert len(stages) >= 2 and all(stage.split()[0] == "${BASE_IMAGE}" for stage in stages), stages
    assert any(keyword == "COPY" and arguments.startswith("--from=") for keyword, arguments in instructions)
    assert ("EXPOSE", str(PORT)) in instructions
    uid, _, gid = image_user().partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit(), "USER must be a numeric non-root uid:gid"
    assert [keyword for keyword, _ in instructions][-1] in {"ENTRYPOINT", "CMD"}
    environment = " ".join(arguments for keyword, arguments in instructions if keyword == "ENV")
    assert f"TOKENIZER_MODELS_DIR={MODELS_DIR}" in environment and "TOKENIZER_HOST=0.0.0.0" in environment


def dockerfile_healthcheck() -> list[str]:
    (healthcheck,) = [arguments for keyword, arguments in dockerfile() if keyword == "HEALTHCHECK"]
    command = json.loads(healthcheck.partition("CMD ")[2])
    assert command[0] == "python", "the slim image has python, not curl"
    return command


def test_dockerfile_healthcheck_follows_readiness(server: Server, tmp_path: Path) -> None:
    """The image's HEALTHCHECK command, run here: passes against a ready server, fails with none."""
    command = [sys.executable, *dockerfile_healthcheck()[1:]]
    port = server.url.rsplit(":", 1)[1]
    ready = subprocess.run(command, env={**os.environ, "TOKENIZER_PORT": port}, capture_output=True, timeout=30)
    assert ready.returncode == 0, ready.stderr
    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        closed = str(sock.getsockname()[1])
        down = subprocess.run(command, env={**os.environ, "TOKENIZER_PORT": closed}, capture_output=True, timeout=30)
    assert down.returncode != 0


# docker compose --------------------------------------------------------------------------------


def test_compose_config_is_valid() -> None:
    docker = require_binary("docker")
    if run([docker, "compose", "version"]).returncode != 0:
        if os.environ.get("TOKENIZER_CI") == "1":
            pytest.fail("the docker compose plugin is missing (.ci/install-compose.sh installs it)")
        pytest.skip("the docker compose plugin is missing")
    result = run([docker, "compose", "config", "-q"])
    assert result.returncode == 0, result.stderr


def test_compose_tokenizer_service_stands_alone() -> None:
    tokenizer = compose()["services"]["tokenizer"]
    assert "depends_on" not in tokenizer, "`docker compose up tokenizer` must start the service alone"
    assert tokenizer["build"]["context"] == "."
    assert tokenizer["build"]["args"]["BASE_IMAGE"] == "${BASE_IMAGE:-python:3.11-slim}"
    assert [port.rsplit(":", 1)[1] for port in tokenizer["ports"]] == [str(PORT)]
    assert tokenizer["environment"]["TOKENIZER_MODELS_DIR"] == MODELS_DIR
    assert tokenizer["environment"]["TOKENIZER_API_KEYS"] == "${TOKENIZER_API_KEYS:-}", "keys come from the shell"
    assert int(re.sub(r"\$\{\w+:-(\d+)\}", r"\1", str(tokenizer["environment"]["TOKENIZER_WORKERS"]))) >= 1
    assert MODELS_DIR in compose_binds(tokenizer)
    test = tokenizer["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, "exec form: the image has python, not curl"
    assert "/readyz" in test[3]
    compile(test[3], "compose healthcheck", "exec")


def test_compose_prometheus_and_grafana_read_deploy_files() -> None:
    services = compose()["services"]
    prometheus = compose_binds(services["prometheus"])
    flags = dict(arg.partition("=")[::2] for arg in services["prometheus"]["command"])
    config = flags["--config.file"]
    directory, _, name = config.rpartition("/")
    assert (ROOT / prometheus[directory] / name).resolve() == PROMETHEUS_CONFIG
    job = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"][0]
    assert job["static_configs"][0]["targets"] == [f"tokenizer:{PORT}"]

    grafana = services["grafana"]
    binds = compose_binds(grafana)
    provisioning = ROOT / binds["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "tokenizer.yml").read_text())["providers"][0]
    assert (ROOT / binds[provider["options"]["path"]]).resolve() == DASHBOARD.parent
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / binds[home.rpartition("/")[0]] / home.rpartition("/")[2]).resolve() == DASHBOARD
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == f"http://prometheus:{services['prometheus']['ports'][0].rsplit(':', 1)[1]}"


# Kubernetes ------------------------------------------------------------------------------------


def test_k8s_manifests_pass_strict_validation() -> None:
    files = sorted(str(path) for path in K8S.glob("*.yaml"))
    result = run([sys.executable, "-m", "kubernetes_validate", "--strict", *files])
    assert result.returncode == 0, result.stdout + result.stderr
    passed = re.findall(r"passed for resource (\S+)", result.stdout + result.stderr)
    assert len(passed) == sum(len(load_documents(Path(file))) for file in files), result.stdout + result.stderr


def test_k8s_pod_is_unprivileged_with_read_only_root() -> None:
    spec, main = pod_spec(), container()
    uid, _, gid = image_user().partition(":")
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (int(uid), int(gid))
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["securityContext"]["capabilities"]["drop"] == ["ALL"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in main["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "a writable /tmp on a read-only root"
    assert MODELS_DIR in mounts and container_env()["TOKENIZER_MODELS_DIR"] == MODELS_DIR
    # API keys come from a Secret, never from the manifest; pods start without it (no keys: open API).
    api_keys = container_env()["TOKENIZER_API_KEYS"]["secretKeyRef"]
    assert api_keys["optional"] is True and api_keys["name"] and api_keys["key"]


def test_k8s_probes_and_cpu_request_match_the_server() -> None:
    main = container()
    port = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert port == {"http": PORT}
    assert (main["readinessProbe"]["httpGet"]["path"], main["readinessProbe"]["httpGet"]["port"]) == ("/readyz", "http")
    assert (main["livenessProbe"]["httpGet"]["path"], main["livenessProbe"]["httpGet"]["port"]) == ("/healthz", "http")
    # One worker process per requested CPU.
    assert float(main["resources"]["requests"]["cpu"]) == int(container_env()["TOKENIZER_WORKERS"])
    annotations = k8s_resources()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(PORT), "/metrics")


def test_k8s_service_hpa_and_budget_select_the_deployment() -> None:
    resources = k8s_resources()
    deployment = resources["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {port["name"] for port in container()["ports"]}
    for kind in ("Service", "HeadlessService"):
        service = resources[kind]["spec"]
        assert service["selector"].items() <= labels.items()
        assert {port["targetPort"] for port in service["ports"]} <= port_names
    assert resources["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = resources["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    assert target["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2 > resources["PodDisruptionBudget"]["spec"]["minAvailable"]


def test_podmonitor_scrapes_the_pods_as_job_tokenizer() -> None:
    """kubernetes-validate has no schema for the PodMonitor CRD, so its fields are checked here."""
    result = run([sys.executable, "-m", "kubernetes_validate", "--strict", str(PODMONITOR)])
    assert "Couldn't find schema for kind PodMonitor" in result.stdout + result.stderr, (
        "kubernetes-validate now knows PodMonitor: validate it with the others"
    )
    (monitor,) = load_documents(PODMONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(monitor["spec"]) == {"jobLabel", "selector", "podMetricsEndpoints"}
    labels = k8s_resources()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    alerts_job = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"][0]["job_name"]
    assert labels[monitor["spec"]["jobLabel"]] == alerts_job
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
    assert endpoint["port"] in {port["name"] for port in container()["ports"]} and endpoint["path"] == "/metrics"


# Grafana ---------------------------------------------------------------------------------------


def test_dashboard_layout_and_datasources() -> None:
    board = dashboard()
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = board["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
        assert all(target["datasource"] == panel["datasource"] for target in panel["targets"]), panel["title"]


def test_dashboard_queries_parse() -> None:
    queries = list(dashboard_queries())
    assert len(queries) > 20
    for where, expr in queries:
        try:
            promql_parser.parse(expr)
        except ValueError as error:
            pytest.fail(f"{where}: {expr!r}: {error}")


def test_dashboard_shows_what_the_issue_asks() -> None:
    """Request rate, p50/p95/p99 per endpoint, tokens/s, queue wait, busy fraction, errors, restarts, padding."""
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    assert {
        "tokenizer_requests_total",
        "tokenizer_request_duration_seconds_bucket",
        "tokenizer_tokens_total",
        "tokenizer_queue_wait_seconds_bucket",
        "tokenizer_worker_seconds_total",
        "tokenizer_workers",
        "tokenizer_worker_restarts_total",
        "tokenizer_pack_padding_ratio_bucket",
    } <= used
    latency = [
        expr for _, expr in dashboard_queries() if "tokenizer_request_duration_seconds_bucket" in metric_names(expr)
    ]
    quantiles = {float(re.match(r"histogram_quantile\(([\d.]+),", expr)[1]) for expr in latency}  # type: ignore[index]
    assert quantiles == {0.5, 0.95, 0.99}
    assert all("by (le, endpoint)" in expr for expr in latency)


def test_dashboard_variables_are_all_defined() -> None:
    defined = {variable["name"] for variable in dashboard()["templating"]["list"]} | {
        "__rate_interval",
        "__range",
        "__all",
    }
    used = set(re.findall(r"\$\{?(\w+)", DASHBOARD.read_text()))
    assert used <= defined, used - defined


# -- pre-tokenizing on a cluster -----------------------------------------------------------------------------


def test_pretokenize_job_is_an_indexed_job_whose_world_size_is_its_completions() -> None:
    resources = k8s_resources()
    ranks, merge = resources["Job/tokenizer-pretokenize"], resources["Job/tokenizer-pretokenize-merge"]
    spec = ranks["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] <= spec["completions"]
    (pod,) = spec["template"]["spec"]["containers"]
    args = pod["args"]
    assert pod["command"] == ["tokenizer-pretokenize"]
    assert int(args[args.index("--world-size") + 1]) == spec["completions"]
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"  # a restarted pod resumes its rank
    output = args[args.index("--output") + 1]
    (merger,) = merge["spec"]["template"]["spec"]["containers"]
    assert merge["spec"]["suspend"] is True and merger["command"] == ["tokenizer-shards", "merge", output]
    claims = {
        volume["persistentVolumeClaim"]["claimName"]
        for job in (ranks, merge)
        for volume in job["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in volume
    }
    assert "tokenizer-corpus" in claims
    for job in (ranks, merge):  # `kubectl apply -f deploy/k8s/ -l ...=tokenizer-service` leaves them out
        assert job["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tokenizer-pretokenize"


@pytest.mark.slow  # array tasks as processes; .ci/run's slow stage
def test_the_slurm_script_runs_as_array_tasks_and_merges(tmp_path: Path, documents: list[str]) -> None:
    script = ROOT / "deploy" / "slurm" / "pretokenize.sbatch"
    assert run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "#SBATCH --array=" in text and "--dependency=afterok" in text
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(3):
        (corpus / f"{part}.jsonl").write_text("".join(f'{{"text": {json.dumps(t)}}}\n' for t in documents[part::3]))
    model = BUNDLED_MODELS_DIR / "default.model"
    for task in (0, 1):  # as Slurm runs the array's tasks: the rank and world size in the environment
        environ = {**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": "0",
                   "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_CPUS_PER_TASK": "1"}  # fmt: skip
        result = subprocess.run(
            ["bash", str(script), str(corpus), str(tmp_path / "shards"), str(model)],
            env=environ, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    # rank 1 resubmitted alone (`sbatch --array=1`: Slurm numbers it 0 of 1), its rank given after MODEL
    environ = {**os.environ, "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "1"}
    again = subprocess.run(
        ["bash", str(script), str(corpus), str(tmp_path / "shards"), str(model), "--rank", "1", "--world-size", "2"],
        env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    merged = run(["tokenizer-shards", "merge", str(tmp_path / "shards")])
    assert merged.returncode == 0, merged.stderr
    assert len(TokenDataset(tmp_path / "shards")) == len(documents)
