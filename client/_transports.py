"""The httpx transports a client opens when it is given none, sharing one verifying SSL context per process.

httpx makes a new SSL context for every transport and loads the CA bundle into it each time. That costs
22-29 ms of CPU here, for every client, every prefetcher (each opens an AsyncTokenizerClient of its own)
and every DataLoader worker that opens one. Here the context is made once, at the first transport, and
shared: an SSLContext is meant to serve many connections, and this one is never handed out, so nothing
changes it. It is httpx's own default context (`httpx.create_ssl_context()`: certificates and host names
verified, SSL_CERT_FILE and SSL_CERT_DIR honoured as the process had them at the first client). A client
given ``transport=`` keeps it as it is.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """The process's verifying SSL context, made on first use (two threads racing make two; either serves)."""
    return httpx.create_ssl_context()


def sync_transport() -> httpx.HTTPTransport:
    return httpx.HTTPTransport(verify=ssl_context())


def async_transport() -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(verify=ssl_context())
