"""client.prefetch against real servers: order and content, the depth bound, a killed server, resume, shutdown."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import re
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.client_servers import GaugedServer, dead_url, gauged_server, numbered_texts, ragged
from tests.conftest import Server
from tokenizer_client import (
    PackSpec,
    PrefetchError,
    RetryPolicy,
    TokenizerClient,
    TokenizerConnectionError,
    TokenizerServiceError,
)
from tokenizer_client.packing import pack_best_fit, pack_concat


@pytest.fixture(scope="module")
def own_server(model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    server = gauged_server(model_files, tmp_path_factory.mktemp("prefetch-server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server):
    with TokenizerClient(server.url) as client:
        yield client


def prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "tokenizer-prefetch"]


class OutageWarned(logging.Handler):
    """Set once the client logs that requests fail on every replica and are being retried (tokenizer_client._outage)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()
        self.logger = logging.getLogger("tokenizer.client")

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()

    def __enter__(self) -> threading.Event:
        self.logger.addHandler(self)
        self._level = self.logger.level
        self.logger.setLevel(logging.WARNING)
        return self.event

    def __exit__(self, *exc_info: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)


def established_to(port: int) -> int:
    connections = psutil.Process().net_connections(kind="tcp")
    return sum(1 for c in connections if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_10000_texts_from_a_generator_in_order(client, server, documents):
    sp = server.processor("bpe")
    got: list[list[int]] = []
    starts, indices = [], []
    with client.prefetch(numbered_texts(documents, 10_000), batch_size=64, depth=4, model="bpe") as batches:
        for batch in batches:
            starts.append(batch.start)
            indices.append(batch.index)
            got.extend(row.tolist() for row in batch.to_list())
        stats = batches.stats
    assert got == sp.encode(list(numbered_texts(documents, 10_000)))
    assert starts == list(range(0, 10_000, 64)) and indices == list(range(len(starts)))
    assert stats.batches == stats.requests == len(starts) and stats.texts == 10_000
    assert stats.tokens == sum(len(row) for row in got) and stats.retries == 0
    assert 0 <= stats.wait_p50_s <= stats.wait_p99_s and 0 < stats.wait_fraction <= 1
    assert 0 < stats.request_p50_s <= stats.request_p99_s
    assert not prefetch_threads()


def test_tokenize_options_apply(client, server, documents):
    texts = documents[:300]
    options = {"add_bos": True, "add_eos": True, "max_length": 20}
    batches = list(client.prefetch(iter(texts), batch_size=50, depth=2, model="uni", **options))
    got = [row.tolist() for batch in batches for row in batch.to_list()]
    encoded = server.processor("uni").encode(texts, add_bos=True, add_eos=True)
    expected = [ids[:19] + ids[-1:] if len(ids) > 20 else ids for ids in encoded]
    assert got == expected
    assert [len(batch) for batch in batches] == [50] * 6


def test_an_endless_generator_is_read_lazily(client):
    read = itertools.count()

    def endless():
        for i in read:
            yield f"text number {i}"

    with client.prefetch(endless(), batch_size=16, depth=4, model="uni") as batches:
        for batch in itertools.islice(batches, 20):
            assert len(batch) == 16
        # 20 batches handed out, at most `depth` more requested, one being read
        assert next(read) <= (20 + 4 + 1) * 16


@pytest.mark.slow  # a server of its own, gauged or killed; .ci/run's slow stage
@pytest.mark.parametrize("depth", [1, 3])
def test_depth_bounds_the_requests_the_server_handles_at_once(own_server: GaugedServer, documents, depth):
    texts = list(numbered_texts(documents, 2400))
    with TokenizerClient(own_server.url) as client:
        own_server.gauge()  # resets the peak
        batches = list(client.prefetch(texts, batch_size=40, depth=depth, model="uni"))
    gauge = own_server.gauge()
    assert len(batches) == 60
    assert gauge["peak"] <= depth
    assert gauge["peak"] >= min(depth, 2)  # the requests really did overlap


@pytest.mark.slow  # a server of its own, gauged or killed; .ci/run's slow stage
def test_a_server_killed_and_restarted_mid_stream_loses_and_repeats_nothing(own_server: GaugedServer, documents):
    texts = list(numbered_texts(documents, 3000))
    expected = own_server_ids(own_server, "bpe", texts)
    restarted = threading.Event()
    killed: list[float] = []
    downtime: list[float] = []

    def restart() -> None:
        assert outage.wait(30), "the client never said it was retrying"  # the killed server is being retried
        own_server.start()  # returns once the server is ready
        downtime.append(time.perf_counter() - killed[0])
        restarted.set()

    got, starts = [], []
    restarter = threading.Thread(target=restart)
    with (
        OutageWarned() as outage,
        TokenizerClient(own_server.url) as client,
        client.prefetch(iter(texts), batch_size=20, depth=4, model="bpe") as batches,
    ):
        for batch in batches:
            starts.append(batch.start)
            got.extend(row.tolist() for row in batch.to_list())
            if batch.index == 30:
                own_server.kill()  # four requests are in flight or about to be sent
                killed.append(time.perf_counter())
                restarter.start()
        stats = batches.stats
    restarter.join()
    assert restarted.is_set()
    assert starts == list(range(0, 3000, 20))
    assert got == expected
    assert stats.retries > 0
    assert stats.request_p99_s > 0.5 * downtime[0]  # the requests in flight waited for the restart


def own_server_ids(own_server: GaugedServer, model: str, texts: list[str], **options) -> list[list[int]]:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(own_server.models[model])).encode(texts, **options)


def run_with_states(client, texts, **options):
    batches, states = [], []
    with client.prefetch(iter(texts), **options) as prefetcher:
        states.append(prefetcher.state_dict())
        for batch in prefetcher:
            batches.append(batch)
            states.append(json.loads(json.dumps(prefetcher.state_dict())))
    return batches, states


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert (a.index, a.start) == (b.index, b.start)
        if hasattr(a, "input_ids"):
            for name in ("input_ids", "labels", "position_ids"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert [row.tolist() for row in a.cu_seqlens] == [row.tolist() for row in b.cu_seqlens]
            assert a.stats == b.stats
        else:
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.offsets, b.offsets)


RESUMABLE = {
    "ragged": {"batch_size": 30, "model": "uni", "add_eos": True},
    "concat": {"batch_size": 30, "model": "bpe", "pack": PackSpec(seq_len=64, rows=4, mask_document_start=True)},
    "best_fit": {"batch_size": 30, "model": "uni", "pack": PackSpec(seq_len=64, rows=3, strategy="best_fit")},
}


@pytest.mark.parametrize("mode", sorted(RESUMABLE))
def test_resuming_from_a_state_dict_gives_exactly_the_remaining_batches(client, documents, mode):
    texts = list(numbered_texts(documents, 600))
    options = RESUMABLE[mode]
    batches, states = run_with_states(client, texts, depth=3, **options)
    assert len(batches) > 12
    if mode != "ragged":
        assert any(state["skip"] for state in states), "some batch ends inside a document or request"
    for cut in (0, 5, len(batches) // 2 + 1, len(batches)):
        resumed, _ = run_with_states(client, texts, depth=2, state=states[cut], **options)
        assert_same_batches(resumed, batches[cut:])


def test_resume_refuses_a_state_of_other_options(client, documents):
    _, states = run_with_states(client, documents[:100], batch_size=30, model="uni")
    with pytest.raises(ValueError, match="options"):
        client.prefetch(documents[:100], batch_size=30, model="bpe", state=states[1])
    with pytest.raises(ValueError, match="ragged"):
        client.prefetch(documents[:100], batch_size=30, model="uni", pack=PackSpec(64, 2), state=states[1])


def test_a_refusal_for_other_options_names_only_those_that_differ(client, documents):
    _, states = run_with_states(client, documents[:100], batch_size=30, model="uni", add_eos=True)
    with pytest.raises(ValueError) as refused:
        client.prefetch(documents[:100], batch_size=30, model="bpe", add_eos=True, max_length=9, state=states[1])
    message = str(refused.value)
    assert "model='uni' (now 'bpe')" in message and "max_length=None (now 9)" in message, message
    assert "add_eos" not in message and "add_bos" not in message and "{" not in message, message
    assert "\n" not in message


@pytest.mark.parametrize("mode", sorted(RESUMABLE))
def test_resuming_on_a_stream_that_does_not_continue_there_names_the_position(client, documents, mode):
    """The issue's case: the generator given on resume was already partly consumed (or the source changed)."""
    texts = list(numbered_texts(documents, 400))
    options = RESUMABLE[mode]
    batches, states = run_with_states(client, texts, depth=2, **options)
    cut = len(batches) // 2
    state = states[cut]
    stopped = state["text"]
    consumed = iter(texts)
    list(itertools.islice(consumed, 40))  # a generator already read for 40 texts
    checked = stopped if state["skip"] else stopped - 1
    with pytest.raises(ValueError, match=rf"stopped \((inside|before) text {stopped}\): its text {checked} "):
        list(client.prefetch(consumed, depth=2, state=state, **options))
    shuffled = [*texts[: stopped - 1], texts[stopped + 5], *texts[stopped - 1 :]]  # one text inserted before
    with pytest.raises(ValueError, match="does not continue where the saved state stopped"):
        list(client.prefetch(iter(shuffled), depth=2, state=state, **options))
    resumed, _ = run_with_states(client, iter(texts), depth=2, state=state, **options)  # the right stream still resumes
    assert_same_batches(resumed, batches[cut:])


def test_an_async_resume_on_another_stream_is_refused_too(server, documents):
    import asyncio

    from tokenizer_client import AsyncTokenizerClient

    texts = list(numbered_texts(documents, 120))

    async def main() -> None:
        async with AsyncTokenizerClient(server.url) as client:
            states = []
            async for _ in client.prefetch(texts, batch_size=20, model="uni"):
                pass
            prefetcher = client.prefetch(texts, batch_size=20, model="uni")
            async for _ in prefetcher:
                states.append(prefetcher.state_dict())
                if len(states) == 3:
                    break
            await prefetcher.aclose()

            async def shifted():
                for text in texts[7:]:
                    yield text

            with pytest.raises(ValueError, match="before text 60\\): its text 59"):
                async for _ in client.prefetch(shifted(), batch_size=20, model="uni", state=states[-1]):
                    pass

    asyncio.run(main())


def test_a_state_saved_without_a_fingerprint_still_resumes_unchecked(client, documents):
    """States saved before the fingerprint was kept (no "last_text") resume as they did: exactly, unchecked."""
    texts = list(numbered_texts(documents, 200))
    batches, states = run_with_states(client, texts, batch_size=30, model="uni")
    old = {key: value for key, value in states[2].items() if key != "last_text"}
    resumed, _ = run_with_states(client, texts, batch_size=30, model="uni", state=old)
    assert_same_batches(resumed, batches[2:])


@pytest.mark.parametrize(("model", "add_bos", "mask"), [("bpe", False, True), ("uni", True, False)])
def test_concat_packing_equals_packing_the_whole_stream(client, server, documents, model, add_bos, mask):
    texts = list(numbered_texts(documents, 900))
    spec = PackSpec(seq_len=128, rows=5, add_bos=add_bos, mask_document_start=mask)
    with client.prefetch(iter(texts), batch_size=37, depth=3, model=model, pack=spec) as prefetcher:
        batches = list(prefetcher)
        leftover = prefetcher.leftover
    sp = server.processor(model)
    ids, offsets = ragged(sp, texts, add_bos=add_bos, add_eos=True)
    whole = pack_concat(ids, offsets, 128, eos_id=sp.eos_id(), mask_document_start=mask)
    assert all(len(batch) == 5 for batch in batches[:-1]) and 1 <= len(batches[-1]) <= 5
    for name in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(np.concatenate([getattr(b, name) for b in batches]), getattr(whole, name))
    got_cu = [row.tolist() for batch in batches for row in batch.cu_seqlens]
    assert got_cu == [whole.row_cu_seqlens(row).tolist() for row in range(whole.num_rows)]
    np.testing.assert_array_equal(leftover, whole.leftover)
    np.testing.assert_array_equal(batches[-1].leftover, whole.leftover)
    assert all(batch.leftover.size == 0 for batch in batches[:-1])
    assert [b.index for b in batches] == list(range(len(batches)))
    assert sum(b.stats["tokens"] for b in batches) + leftover.size == ids.size


def test_best_fit_packs_each_request_on_the_server_and_regroups_rows(client, server, documents):
    texts = list(numbered_texts(documents, 400))
    spec = PackSpec(seq_len=96, rows=6, strategy="best_fit", mask_document_start=True)
    batches = list(client.prefetch(texts, batch_size=50, depth=3, model="uni", pack=spec))
    sp = server.processor("uni")
    expected = []
    for start in range(0, 400, 50):
        ids, offsets = ragged(sp, texts[start : start + 50], add_eos=True)
        expected.append(pack_best_fit(ids, offsets, 96, pad_id=sp.eos_id(), mask_document_start=True))
    for name in ("input_ids", "labels", "position_ids"):
        rows = np.concatenate([getattr(packed, name) for packed in expected])
        np.testing.assert_array_equal(np.concatenate([getattr(b, name) for b in batches]), rows)
    assert all(len(b) == 6 for b in batches[:-1]) and len(batches[-1]) <= 6
    assert all(b.leftover.size == 0 for b in batches)


@pytest.mark.slow  # a server of its own, gauged or killed; .ci/run's slow stage
def test_close_break_with_and_garbage_collection_stop_everything(own_server: GaugedServer, documents):
    texts = list(numbered_texts(documents, 2000))
    before = set(threading.enumerate())
    with TokenizerClient(own_server.url) as client:
        prefetcher = client.prefetch(texts, batch_size=100, depth=4, model="bpe")
        next(prefetcher)
        assert len(prefetch_threads()) == 1 and established_to(own_server.port) >= 1
        started = time.perf_counter()
        prefetcher.close()
        assert time.perf_counter() - started < 2.0
        assert set(threading.enumerate()) == before
        assert established_to(own_server.port) == 0
        with pytest.raises(StopIteration):
            next(prefetcher)

        for _ in client.prefetch(texts, batch_size=100, depth=4, model="bpe"):
            break
        assert set(threading.enumerate()) == before

        with client.prefetch(texts, batch_size=100, depth=4, model="bpe") as prefetcher:
            next(prefetcher)
        assert prefetcher.closed and set(threading.enumerate()) == before

        abandoned = client.prefetch(texts, batch_size=100, depth=4, model="bpe")
        next(abandoned)
        del abandoned
        gc.collect()
        assert set(threading.enumerate()) == before

        left_open = client.prefetch(texts, batch_size=100, depth=4, model="bpe")
    assert left_open.closed, "closing the client closes its prefetchers"
    assert set(threading.enumerate()) == before and established_to(own_server.port) == 0
    assert own_server.gauge()["now"] == 0 or wait_for_idle(own_server)


def wait_for_idle(server: GaugedServer) -> bool:
    """Requests cancelled on the client finish on the server shortly after; the server is not left busy."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.gauge()["now"] == 0:
            return True
        time.sleep(0.05)
    return False


def test_close_is_prompt_while_retrying():
    with OutageWarned() as outage, TokenizerClient(dead_url()) as client:
        prefetcher = client.prefetch(["never sent"] * 10, batch_size=2, depth=4)
        assert outage.wait(10)  # requests are failing and backing off
        started = time.perf_counter()
        prefetcher.close()
        assert time.perf_counter() - started < 2.0
    assert not prefetch_threads()


def test_past_the_retry_budget_next_raises_with_the_position():
    with TokenizerClient(dead_url()) as client:
        prefetcher = client.prefetch(["a", "b", "c"], batch_size=2, retry=RetryPolicy(budget_s=0.5))
        started = time.perf_counter()
        with pytest.raises(PrefetchError) as caught:
            next(prefetcher)
    assert 0.45 < time.perf_counter() - started < 5  # the whole budget was used
    error = caught.value
    assert (error.batch_index, error.text_start, error.text_stop) == (0, 0, 2)
    assert isinstance(error.cause, TokenizerConnectionError) and "attempts" in str(error.cause)
    assert prefetcher.closed and not prefetch_threads()


def test_errors_retrying_cannot_fix_come_at_once_after_the_batches_before_them(client, documents):
    texts = [*documents[:95], "a lone \ud800 surrogate", *documents[95:200]]
    prefetcher = client.prefetch(iter(texts), batch_size=20, depth=4, model="uni")
    delivered = [next(prefetcher) for _ in range(4)]
    started = time.perf_counter()
    with pytest.raises(PrefetchError) as caught:
        next(prefetcher)
    assert time.perf_counter() - started < 2
    assert [b.start for b in delivered] == [0, 20, 40, 60]
    error = caught.value
    assert (error.batch_index, error.text_start, error.text_stop, error.text_index) == (4, 80, 100, 95)
    assert isinstance(error.cause, TokenizerServiceError) and error.cause.status == 422
    assert prefetcher.closed and not prefetch_threads()

    started = time.perf_counter()
    with pytest.raises(PrefetchError) as caught:
        next(client.prefetch(documents[:10], model="no-such-model"))
    assert caught.value.cause.status == 404 and time.perf_counter() - started < 2


def test_errors_of_the_text_source_are_raised_in_order(client, documents):
    def failing():
        yield from documents[:50]
        raise RuntimeError("the corpus reader broke")

    prefetcher = client.prefetch(failing(), batch_size=20, depth=4, model="uni")
    assert [len(next(prefetcher)) for _ in range(2)] == [20, 20]  # texts 40-49 are lost with the failed read
    with pytest.raises(RuntimeError, match="corpus reader broke"):
        next(prefetcher)
    with pytest.raises(TypeError, match="text 3 is a bytes"):
        list(client.prefetch(["a", "b", "c", b"d"], batch_size=2))
    with pytest.raises(TypeError, match=r"not a single str: for one text, pass \[text\]"):
        client.prefetch("a single text")
    assert not prefetch_threads()


def test_a_server_that_is_down_is_logged_once_while_prefetch_retries(caplog):
    caplog.set_level(logging.INFO, logger="tokenizer.client")
    url = dead_url()
    policy = RetryPolicy(budget_s=1.0, initial_backoff_s=0.01, max_backoff_s=0.05)
    with TokenizerClient(url) as client:
        prefetcher = client.prefetch([f"text {i}" for i in range(8)], batch_size=2, depth=4, retry=policy)
        with pytest.raises(PrefetchError):
            next(prefetcher)
        with pytest.raises(TokenizerConnectionError):
            client.tokenize(["no retry policy: one try, raised, not logged"])
    # Four requests in flight, each failing a round every 50 ms or less for a second: one warning.
    records = [record for record in caplog.records if record.name == "tokenizer.client"]
    assert [record.levelname for record in records] == ["WARNING"]
    message = records[0].getMessage()
    assert message.startswith(f"POST /v1/tokenize failed on replica {url} (last error: ")
    assert "ConnectError" in message and "budget_s=1," in message
    left = re.search(r"retrying for up to ([0-9.]+) s more", message)
    assert left and float(left.group(1)) > 0.5, "logged after the first round, not when giving up"
