"""tokenizer-service (create_app, settings from TOKENIZER_*) behind a gauge of concurrent /v1/ requests.

The client tests' own server (tests/client_servers.py starts it with tokenizer_service.tools.launcher.ServerProcess).
"""

from __future__ import annotations

import argparse
import json

import uvicorn

from tokenizer_service.http.factory import create_app
from tokenizer_service.settings import Settings


class ConcurrencyGauge:
    """Plain ASGI: counts /v1/ requests from the call into the app until the last byte of the answer is sent.

    GET /_gauge answers {"now", "peak", "total", "authorization"} and resets the peak to "now".
    """

    def __init__(self, app):
        self.app = app
        self.now = self.peak = self.total = 0
        self.authorization = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/_gauge":
            body = json.dumps(
                {"now": self.now, "peak": self.peak, "total": self.total, "authorization": self.authorization}
            ).encode()
            self.peak = self.now
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.authorization = (headers.get(b"authorization") or b"").decode() or None
        self.now += 1
        self.total += 1
        self.peak = max(self.peak, self.now)
        done = False

        async def send_and_count(message):
            # The answer is complete once its last body chunk is in the socket; the client may send its
            # next request from then on, while the app still runs its own bookkeeping. uvicorn does not
            # yield between writing that chunk and returning here, so no request can be counted between.
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not done:
                done = True
                self.now -= 1

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            if not done:
                self.now -= 1


def main() -> None:
    """`python -m tests.gauged_server --host H --port P`; every other setting from TOKENIZER_*."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(ConcurrencyGauge(create_app(Settings())), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":  # worker processes are spawned: they import this module under another name
    main()
