"""The service's error tree: every error has an HTTP status (found along its MRO) and crosses the worker
channel intact (`as_dict` -> bytes -> `from_dict`), without a server."""

from __future__ import annotations

import orjson
import pytest

from tokenizer_service.core import errors
from tokenizer_service.core.errors import RequestTimeout, ServiceError, SlowBody, Unauthorized
from tokenizer_service.http.status import STATUS, error_body, error_headers, error_status


def all_errors() -> list[type[ServiceError]]:
    found, todo = [], [ServiceError]
    while todo:
        kind = todo.pop()
        found.append(kind)
        todo.extend(kind.__subclasses__())
    return found


KINDS = [kind for kind in all_errors() if kind is not ServiceError]


def test_the_tree_is_found():
    assert {Unauthorized, RequestTimeout, SlowBody} <= set(KINDS)
    assert len(KINDS) == len({name for name in dir(errors) if name[0].isupper()} - {"ServiceError", "Any"})


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_every_error_has_a_client_error_or_unavailable_status(kind):
    error = kind("what went wrong")
    assert 400 <= error_status(error) < 600 and error_status(error) != 500
    assert orjson.loads(error_body(error))["error"]["type"] == kind.type


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_every_error_survives_the_worker_channel(kind):
    error = kind("what went wrong", field="texts", index=3)
    back = ServiceError.from_dict(orjson.loads(orjson.dumps(error.as_dict())))
    assert (
        back.as_dict()
        == error.as_dict()
        == {
            "type": kind.type,
            "message": "what went wrong",
            "field": "texts",
            "index": 3,
        }
    )
    owner = next(base for base in kind.__mro__ if base.type == kind.type and base.__base__.type != kind.type)
    assert type(back) is owner  # its own class, or the parent whose `type` it shares
    assert isinstance(error, type(back))


def test_a_subclass_keeps_its_parents_status_unless_it_has_its_own():
    class Later(RequestTimeout):
        pass

    assert error_status(Later("x")) == STATUS[RequestTimeout] == 504
    assert error_status(SlowBody("x")) == 408  # its own, not its parent's


def test_an_unknown_type_is_an_internal_error():
    back = ServiceError.from_dict({"type": "no_such_thing", "message": "m"})
    assert type(back) is ServiceError and error_status(back) == 500


def test_retry_after_for_overload_and_unavailability_only():
    with_retry = {kind for kind in KINDS if "Retry-After" in error_headers(kind("x"))}
    assert with_retry == {errors.Overloaded, errors.Unavailable}
    assert all(error_status(kind("x")) == 503 for kind in with_retry)
