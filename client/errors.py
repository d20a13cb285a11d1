"""The client's exception tree: everything the transport or the server can do wrong, translated once."""

from __future__ import annotations

from typing import Any

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


class TokenizerError(Exception):
    """Base of every error this client raises."""


class TokenizerConnectionError(TokenizerError):
    """The server could not be reached, or the connection failed mid-request."""


class TokenizerProtocolError(TokenizerError):
    """The server answered something this client cannot read."""


class MalformedAnswerError(TokenizerProtocolError):
    """A 200 answer that does not fit its request: texts missing, offsets out of order or out of range, ids
    that are not int32 token ids, shapes that do not match. Never returned as data."""


class TokenizerServiceError(TokenizerError):
    """The server answered with an error status; `body` is its JSON error body, `url` the URL requested.

    The message starts with the URL (when known) and, where the answer says what to change, ends with it:
    a 404 for a path the service does not have, from a base URL with a path of its own, says to give the
    server's root URL instead.
    """

    def __init__(
        self,
        status: int,
        body: dict[str, Any] | None,
        retry_after: float | None = None,
        *,
        url: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.status = status
        self.url = url
        self.body = body or {}
        found = self.body.get("error")
        error: dict[str, Any] = found if isinstance(found, dict) else {}
        self.error_type: str | None = error.get("type")
        self.message: str = error.get("message") or f"HTTP {status}"
        self.field: str | None = error.get("field")
        self.index: int | None = error.get("index")
        self.retry_after = retry_after
        where = f" (field {self.field!r}, index {self.index})" if self.index is not None else ""
        requested = f"{url}: " if url else ""
        advice = f"; {hint}" if hint else ""
        super().__init__(f"{requested}{status} {self.error_type or 'error'}: {self.message}{where}{advice}")

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later (overload, timeout, restart)."""
        return self.status in RETRYABLE_STATUSES


class ModelMismatchError(TokenizerError):
    """Two answers for the same model name came from different model files (sha256 differs)."""


class PrefetchError(TokenizerError):
    """A prefetched request failed for good (retries spent, or an error retrying cannot fix).

    Raised from ``next()`` once every batch before it has been handed out. ``batch_index`` is the
    number of the batch that could not be made, ``text_start``/``text_stop`` the stream indices of
    the request's texts, ``text_index`` the stream index of the text the server named (422), and
    ``cause`` (also ``__cause__``) the TokenizerError of the last attempt.
    """

    def __init__(
        self, message: str, *, batch_index: int, text_start: int, text_stop: int, text_index: int | None = None
    ) -> None:
        super().__init__(message)
        self.batch_index = batch_index
        self.text_start = text_start
        self.text_stop = text_stop
        self.text_index = text_index

    @property
    def cause(self) -> BaseException | None:
        return self.__cause__
