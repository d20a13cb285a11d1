"""Which model files a client's replicas serve: every answer's model sha256 checked against the earlier ones."""

from __future__ import annotations

from typing import Any

from tokenizer_client.errors import ModelMismatchError


class ModelFingerprints:
    """Remembers each model's sha256, and which model a request without one got, per client.

    Replicas behind one client must serve the same files: an answer whose sha256 differs from an
    earlier one for the same model name, or a default model that differs between replicas, raises
    ModelMismatchError. Safe to share between threads (one dict operation per check).
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}
        self._default: tuple[str, str] | None = None

    def check(self, model: str, sha256: str | None, source: str, *, requested: str | None) -> None:
        """`requested` is the model name the request gave (None: the server's default)."""
        if requested is None:
            if self._default is None:
                self._default = (model, source)
            elif self._default[0] != model:
                raise ModelMismatchError(
                    f"{source} serves {model!r} as its default model, {self._default[1]} served {self._default[0]!r}"
                )
        if sha256 is None:
            return
        known, known_source = self._seen.setdefault(model, (sha256, source))
        if known != sha256:
            raise ModelMismatchError(
                f"model {model!r} from {source} has sha256 {sha256[:12]}…, "
                f"earlier answers from {known_source} had {known[:12]}…"
            )

    def expect(self, model: str, sha256: str, source: str) -> None:
        """Pin a model's sha256 before any answer (a resumed prefetch must see the file it started with)."""
        self._seen.setdefault(model, (sha256, source))


def check_replica_models(fingerprints: ModelFingerprints, answers: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Raise ModelMismatchError unless every replica's /v1/models names the same files and default.

    `answers` are (url, /v1/models document) for every replica; returns the first document.
    """
    for url, document in answers:
        for info in document.get("models", []):
            fingerprints.check(info["name"], info.get("sha256"), url, requested=info["name"])
        if (default := document.get("default")) is not None:
            fingerprints.check(default, None, url, requested=None)
    return answers[0][1]
