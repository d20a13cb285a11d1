"""Prefetch: tokenize a stream of texts ahead of a training loop, so that the loop never waits on tokenization.

``client.prefetch(texts, ...)`` returns a :class:`Prefetcher`, an iterator of batches in stream order:

* ``texts`` is any iterable of str (an endless generator too). It is read lazily, in the thread that
  calls ``next()``, never more than ``depth`` requests of ``batch_size`` texts ahead.
* Up to ``depth`` requests are in flight, on one background thread that runs an event loop with its
  own connection pool. Batches come out in input order; memory holds at most ``depth`` answers plus
  the batches cut from the one being handed out.
* A failed request is retried (``RetryPolicy``: connection errors, 429/502/503/504 honouring
  Retry-After, failover to another replica) with the same texts, so no text is lost or repeated.
  Past the retry budget, or on an error that retrying cannot fix (401, 404, 413, 422), ``next()``
  raises :class:`PrefetchError` once the batches before it have been handed out. While requests
  retry, the logger "tokenizer.client" says so, once per outage (tokenizer_client._outage).
* ``break``, ``close()``, the end of a ``with`` block, the end of the stream or garbage collection
  stop the background work: requests in flight are cancelled, connections closed, the thread joined.
* ``stats`` says how long the consumer waited in ``next()``; ``state_dict()`` says where to resume.

With ``pack=PackSpec(seq_len, rows)`` the batches are :class:`PackedBatch` of exactly ``rows`` rows of
``seq_len`` tokens (the last one may have fewer rows). ``concat`` tokenizes windows with /v1/tokenize,
any number in flight, and cuts the rows in the client, in stream order (see tokenizer_client.prefetch.rows: a
/v1/pack request with ``carry`` needs the previous one's leftover, which would allow only one request in flight).
``best_fit`` packs each window of ``batch_size`` texts on the server (/v1/pack; no carry) and
regroups the rows.

:class:`AsyncPrefetcher` is the same for asyncio code (``AsyncTokenizerClient.prefetch``).

Both run the one pipeline of tokenizer_client.prefetch.pipeline: its requests and in-order assembly on an event
loop (the caller's, or for Prefetcher one on a thread of its own: .loop), its bound, order, errors,
state and stats on the consumer's side. The two classes (.prefetchers) only wait: AsyncPrefetcher awaits, and
Prefetcher blocks in ``next()`` only while the answer it needs is not in yet, so that handing out a
batch whose answer has arrived never waits on the loop thread. The pieces without I/O:
tokenizer_client.prefetch.options (PackSpec, PrefetchOptions), .texts (windows of texts), .assembler (answers to
batches), .rows (rows cut and regrouped), .resume (state_dict and resume), .stats (PrefetchStats).
"""

from __future__ import annotations

from tokenizer_client.prefetch.options import PackSpec, PrefetchOptions
from tokenizer_client.prefetch.prefetchers import AsyncPrefetcher, Prefetcher
from tokenizer_client.prefetch.stats import PrefetchStats

__all__ = ["AsyncPrefetcher", "PackSpec", "PrefetchOptions", "PrefetchStats", "Prefetcher"]
