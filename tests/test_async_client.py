"""AsyncTokenizerClient against the real server: the same answers as in-process sentencepiece, and async prefetch."""

from __future__ import annotations

import asyncio
import gc
import json

import httpx
import numpy as np
import pytest

from tests.client_servers import numbered_texts, ragged
from tests.conftest import Server
from tokenizer_client import (
    AsyncTokenizerClient,
    PackSpec,
    TokenizerClient,
    TokenizerServiceError,
)
from tokenizer_client.packing import pack_concat


class CountingTransport(httpx.AsyncHTTPTransport):
    """Counts requests between sending and the answer's arrival, at the client's own transport."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            return await super().handle_async_request(request)
        finally:
            self.now -= 1


def test_the_async_api_answers_like_sentencepiece(server: Server, documents):
    texts = documents[:120]
    sp = server.processor("uni")

    async def main() -> None:
        async with AsyncTokenizerClient(server.url) as client:
            assert await client.ready()
            ids = await client.tokenize(texts, model="uni", add_eos=True)
            assert [row.tolist() for row in ids] == sp.encode(texts, add_eos=True)
            batch = await client.tokenize_batch(texts, model="uni", format="json")
            assert batch.to_list()[5].tolist() == sp.encode(texts[5])
            assert await client.detokenize(ids, model="uni") == sp.decode(sp.encode(texts, add_eos=True))
            models = await client.models()
            assert {"uni", "bpe", "default"} <= {m["name"] for m in models["models"]}
            packed = await client.pack(texts, 64, model="uni")
            flat, offsets = ragged(sp, texts, add_eos=True)
            np.testing.assert_array_equal(packed.input_ids, pack_concat(flat, offsets, 64).input_ids)
            with pytest.raises(TokenizerServiceError) as caught:
                await client.tokenize(["x"], model="missing")
            assert caught.value.status == 404
        assert client.closed
        with pytest.raises(RuntimeError, match="closed"):
            await client.tokenize(["x"])

    asyncio.run(main())


def test_async_prefetch_over_an_async_generator_in_order_within_depth(server: Server, documents):
    count = 3000
    transport = CountingTransport()

    async def texts():
        for text in numbered_texts(documents, count):
            if len(text) % 7 == 0:
                await asyncio.sleep(0)
            yield text

    async def main() -> tuple[list[list[int]], list[int], object]:
        got, starts = [], []
        async with (
            AsyncTokenizerClient(server.url, transport=transport) as client,
            client.prefetch(texts(), batch_size=50, depth=3, model="bpe") as batches,
        ):
            async for batch in batches:
                starts.append(batch.start)
                got.extend(row.tolist() for row in batch.to_list())
            return got, starts, batches.stats

    got, starts, stats = asyncio.run(main())
    assert got == server.processor("bpe").encode(list(numbered_texts(documents, count)))
    assert starts == list(range(0, count, 50))
    assert stats.batches == 60 and stats.texts == count
    assert 2 <= transport.peak <= 3


def test_async_prefetch_resumes_and_packs_like_the_sync_one(server: Server, documents):
    texts = list(numbered_texts(documents, 500))
    spec = PackSpec(seq_len=64, rows=4, mask_document_start=True)
    with TokenizerClient(server.url) as client:
        expected = list(client.prefetch(texts, batch_size=40, model="bpe", pack=spec))

    async def run(state=None):
        batches, states = [], []
        async with AsyncTokenizerClient(server.url) as client:
            prefetcher = client.prefetch(texts, batch_size=40, depth=2, model="bpe", pack=spec, state=state)
            async for batch in prefetcher:
                batches.append(batch)
                states.append(json.loads(json.dumps(prefetcher.state_dict())))
        return batches, states

    batches, states = asyncio.run(run())
    resumed, _ = asyncio.run(run(states[9]))
    for got, want in zip(batches + resumed, expected + expected[10:], strict=True):
        assert got.index == want.index
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        np.testing.assert_array_equal(got.labels, want.labels)


def test_async_prefetch_stops_its_tasks_on_aclose_break_and_garbage_collection(server: Server, documents):
    texts = documents * 3

    async def others() -> set[asyncio.Task]:
        await asyncio.sleep(0)
        return asyncio.all_tasks() - {asyncio.current_task()}

    async def main() -> None:
        async with AsyncTokenizerClient(server.url) as client:
            prefetcher = client.prefetch(texts, batch_size=100, depth=4, model="uni")
            await prefetcher.__anext__()
            assert await others()
            await prefetcher.aclose()
            assert not await others()
            with pytest.raises(StopAsyncIteration):
                await prefetcher.__anext__()

            async with client.prefetch(texts, batch_size=100, depth=4, model="uni") as prefetcher:
                async for _ in prefetcher:
                    break
            assert not await others()

            abandoned = client.prefetch(texts, batch_size=100, depth=4, model="uni")
            await abandoned.__anext__()
            del abandoned
            gc.collect()
            # The finalizer cancels the abandoned tasks from the loop's next turn: wait until they have ended.
            await asyncio.wait_for(asyncio.gather(*await others(), return_exceptions=True), timeout=10)
            assert not await others()

    asyncio.run(main())


def test_aclose_closes_the_prefetchers_it_started(server, documents):
    """As TokenizerClient.close does: nothing keeps requesting after the client is closed."""

    async def run() -> None:
        client = AsyncTokenizerClient(server.url)
        prefetcher = client.prefetch(iter(documents * 50), batch_size=8, depth=4, model="uni")
        first = await prefetcher.__anext__()
        assert len(first) == 8
        await client.aclose()
        assert prefetcher._closed and client.closed

    asyncio.run(run())
