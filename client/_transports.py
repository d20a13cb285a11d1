"""The httpx transports a client opens when it is given none, sharing one verifying SSL context per process.

httpx makes a new SSL context for every transport and loads the CA bundle into it each time. That costs
22-29 ms of CPU here, for every client and every prefetcher (each opens an AsyncTokenizerClient of its own).
Here the context is made once per process, at the first transport, and shared: an SSLContext is meant to
serve many connections. It is httpx's own default context (`httpx.create_ssl_context()`: certificates and
host names verified; SSL_CERT_FILE and SSL_CERT_DIR are read once, as the process had them at the first
client). This module never hands it out. httpcore sets the same ALPN protocols on it for every TLS
connection it opens, as it did on each client's own context, which several threads already shared
through one client. A process forked after the first client (a DataLoader worker) inherits the context;
one started fresh makes its own. A client given ``transport=`` keeps that transport as it is.
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
