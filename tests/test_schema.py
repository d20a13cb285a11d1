"""schemathesis against the server's own OpenAPI document: every operation, a bounded number of
generated requests each, no 5xx, and every answer (status, headers, body) as the schema says.

Run twice: on the shared test server, and on one with API keys, whose schema declares bearer auth
(schemathesis then also checks that a request without the key is refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # schemathesis over every operation; part of .ci/run's slow stage

API_KEY = "schema-test-key"
EXAMPLES = 40

# Not checked: that every schema-valid body is accepted. The server refuses (422, with the documented
# error body) some bodies JSON Schema cannot rule out: ids beyond the chosen model's vocabulary,
# seq_len beyond --max-seq-len, 1.0 where pydantic's strict integers want 1.
LENIENT = [schemathesis.checks.positive_data_acceptance]


@pytest.fixture(scope="module")
def keyed_url(model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("keyed") / "server.log"
    args = ["--workers", "1", "--model", f"uni={model_files['uni']}", "--log-level", "warning"]
    url, process = start_server(args, log, env={"TOKENIZER_API_KEYS": API_KEY})
    yield url
    stop_server(process)


@pytest.fixture
def open_schema(server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


@pytest.fixture
def keyed_schema(keyed_url: str) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{keyed_url}/openapi.json")
    schema.config.update(headers={"Authorization": f"Bearer {API_KEY}"})  # fixed, not generated
    return schema


bounded = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@schemathesis.pytest.from_fixture("open_schema").parametrize()
@bounded
def test_every_answer_matches_the_schema(case):
    case.call_and_validate(excluded_checks=LENIENT)


@schemathesis.pytest.from_fixture("keyed_schema").parametrize()
@bounded
def test_every_answer_matches_the_schema_with_api_keys(case):
    response = case.call_and_validate(excluded_checks=LENIENT)
    # The key is sent, so a 401 only answers the cases schemathesis makes without it on purpose:
    # this is not a run that only ever saw refusals.
    scenario = getattr(getattr(getattr(case, "meta", None), "phase", None), "data", None)
    if getattr(scenario, "parameter", None) != "Authorization":
        assert response.status_code != 401
