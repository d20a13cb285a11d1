"""Optional API keys: `Authorization: Bearer KEY`, compared in constant time.

Deny by default: with keys configured, every path needs one except the probes, the metrics and
the API description, so a route added later is protected without anyone remembering to.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import Scope

OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    | {  # the docs pages' own assets (tokenizer_service.http.docs_ui), which a browser fetches without a key
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
        "/docs/assets/redoc.standalone.js",
        "/docs/assets/favicon.png",
    }
)


def route_path(scope: Scope) -> str:
    """The path the router matches: without the root path a proxy may mount the app under."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps even a key's length out of the timing.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The configured keys, kept only as sha256 digests."""

    def __init__(self, keys: list[str]) -> None:
        if not keys or any(not key for key in keys):
            raise ValueError("API keys must be non-empty")
        self._digests = [_digest(key) for key in keys]

    def accepts(self, token: str) -> bool:
        """Compare against every key, without stopping at a match, so timing says nothing of which."""
        candidate = _digest(token)
        accepted = False
        for digest in self._digests:
            accepted |= hmac.compare_digest(candidate, digest)
        return accepted


def bearer_token(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
