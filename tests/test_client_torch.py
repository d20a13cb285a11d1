"""Torch output of the prefetcher, pinning as the build allows, the DataLoader dataset, the client without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from tests.client_servers import numbered_texts
from tests.conftest import ROOT, Server
from tokenizer_client import PackSpec, TokenizerClient

torch = pytest.importorskip("torch")

from tokenizer_client import _torch  # noqa: E402
from tokenizer_client.torch_data import TokenizedIterableDataset, shard_blocks  # noqa: E402


@pytest.fixture(scope="module")
def client(server: Server):
    with TokenizerClient(server.url) as client:
        yield client


def test_the_client_works_without_torch(server: Server):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import tokenizer_client
        from tokenizer_client import PackSpec, TokenizerClient
        with TokenizerClient({server.url!r}) as c:
            assert sum(len(b) for b in c.prefetch(["a", "b", "c"] * 10, batch_size=7)) == 30
            assert list(c.prefetch(["x"] * 50, pack=PackSpec(8, 2), model="uni"))
            try:
                c.prefetch(["a"], as_torch=True)
            except ImportError as exc:
                assert "tokenizer-service[torch]" in str(exc)
            else:
                raise AssertionError("as_torch=True without torch must fail at once")
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_ragged_batches_as_tensors(client, documents):
    texts = documents[:200]
    plain = list(client.prefetch(texts, batch_size=64, model="uni"))
    tensors = list(client.prefetch(texts, batch_size=64, model="uni", as_torch=True))
    for a, b in zip(plain, tensors, strict=True):
        assert b.ids.dtype == torch.int32 and b.offsets.dtype == torch.int64
        assert b.ids.shape == (a.num_tokens,) and b.offsets.shape == (len(a) + 1,)
        np.testing.assert_array_equal(b.ids.numpy(), a.ids)
        assert [row.tolist() for row in b.to_list()] == [row.tolist() for row in a.to_list()]


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_packed_batches_as_tensors_pinned_when_torch_can(client, documents, strategy, monkeypatch):
    monkeypatch.setattr(_torch, "_warned", False)
    spec = PackSpec(seq_len=256, rows=4, strategy=strategy)
    pinnable = _torch.can_pin(torch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prefetcher = client.prefetch(
            documents[:400], batch_size=50, model="bpe", pack=spec, as_torch=True, pin_memory=True
        )
        second = client.prefetch(documents[:10], model="bpe", pack=spec, as_torch=True, pin_memory=True)
        second.close()
    ignored = [
        w for w in caught if issubclass(w.category, RuntimeWarning) and "pin_memory=True ignored" in str(w.message)
    ]
    # torch 2.13.0+cpu: pinning raises "Cannot access accelerator device when none is available";
    # the prefetcher warns once per process and hands out ordinary tensors.
    assert len(ignored) == (0 if pinnable else 1)
    batches = list(prefetcher)
    assert len(batches) >= 3
    for batch in batches[:-1]:
        for name in ("input_ids", "labels", "position_ids"):
            tensor = getattr(batch, name)
            assert tensor.shape == (4, 256) and tensor.dtype == torch.int32
            assert tensor.is_pinned() == pinnable
        assert all(row.dtype == torch.int32 and int(row[-1]) <= 256 for row in batch.cu_seqlens)
    assert batches[-1].input_ids.shape[0] <= 4


def test_pin_memory_needs_torch_output(client):
    with pytest.raises(ValueError, match="as_torch"):
        client.prefetch(["a"], pin_memory=True)


def test_shards_cover_the_stream_without_overlap():
    texts = [f"t{i}" for i in range(103)]
    shards = [list(shard_blocks(iter(texts), 10, worker, 3)) for worker in range(3)]
    assert sorted(text for shard in shards for text in shard) == sorted(texts)
    assert shards[1][:10] == texts[10:20] and shards[1][10:20] == texts[40:50]


def test_a_dataloader_over_two_workers_gives_the_stream_in_order(server: Server, documents):
    texts = list(numbered_texts(documents, 1000))
    dataset = TokenizedIterableDataset(lambda: iter(texts), server.url, batch_size=50, model="uni", depth=2)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    batches = list(loader)
    assert [b.index for b in batches] == list(range(20))
    assert [b.start for b in batches] == list(range(0, 1000, 50))
    got = [row.tolist() for batch in batches for row in batch.to_list()]
    assert got == server.processor("uni").encode(texts)
    assert isinstance(batches[0].ids, torch.Tensor)


def assert_same_rows(got, want) -> None:
    assert [b.index for b in got] == [b.index for b in want]
    for a, b in zip(got, want, strict=True):
        if hasattr(b, "input_ids"):
            for name in ("input_ids", "labels", "position_ids"):
                np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
        else:
            assert a.start == b.start
            np.testing.assert_array_equal(np.asarray(a.ids), np.asarray(b.ids))
            np.testing.assert_array_equal(np.asarray(a.offsets), np.asarray(b.offsets))


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_packed_rows_are_the_same_for_any_number_of_workers(server: Server, documents, client, strategy):
    """Rows run across documents and requests: worker 0 packs the whole stream, as one prefetcher would."""
    texts = list(numbered_texts(documents, 600))
    spec = PackSpec(seq_len=128, rows=4, strategy=strategy)
    alone = list(client.prefetch(texts, batch_size=40, model="bpe", pack=spec))
    assert len(alone) > 8
    for workers in (0, 1, 3):
        dataset = TokenizedIterableDataset(texts, server.url, batch_size=40, model="bpe", pack=spec)
        batches = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers))
        assert_same_rows(batches, alone)


STATEFUL = {
    "ragged": {"batch_size": 30, "model": "uni", "add_eos": True},
    "concat": {"batch_size": 30, "model": "bpe", "pack": PackSpec(seq_len=64, rows=4)},
    "best_fit": {"batch_size": 30, "model": "uni", "pack": PackSpec(seq_len=64, rows=3, strategy="best_fit")},
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", sorted(STATEFUL))
def test_a_stateful_dataloader_resumes_with_the_rows_of_an_uninterrupted_run(server: Server, documents, mode, workers):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    texts = list(numbered_texts(documents, 400))
    options = STATEFUL[mode]

    def loader() -> object:
        dataset = TokenizedIterableDataset(lambda: iter(texts), server.url, depth=2, **options)
        return stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=workers)

    whole = list(loader())
    assert len(whole) > 10
    for cut in (3, len(whole) // 2 + 1):
        first = loader()
        got = []
        for batch in first:
            got.append(batch)
            if len(got) == cut:
                break
        saved = first.state_dict()
        del first
        second = loader()
        second.load_state_dict(saved)
        got += list(second)
        assert_same_rows(got, whole)


def test_a_dataset_state_resumes_in_the_main_process_and_is_plain_json(server: Server, documents):
    import json

    texts = list(numbered_texts(documents, 200))
    dataset = TokenizedIterableDataset(texts, server.url, batch_size=25, model="uni")
    assert dataset.state_dict()["prefetch"] is None  # before any batch: the stream's start
    whole = list(dataset)
    iterator = iter(dataset)
    head = [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(dataset.state_dict()))
    iterator.close()
    resumed = TokenizedIterableDataset(texts, server.url, batch_size=25, model="uni")
    resumed.load_state_dict(state)
    assert_same_rows(head + list(resumed), whole)
    assert_same_rows(list(resumed), whole)  # the next epoch starts the stream again


def test_a_ragged_state_from_another_number_of_workers_is_refused(server: Server, documents):
    texts = list(numbered_texts(documents, 100))
    dataset = TokenizedIterableDataset(texts, server.url, batch_size=25, model="uni")
    dataset.load_state_dict({**dataset.state_dict(), "worker": 1, "workers": 2})
    with pytest.raises(ValueError, match="worker 1 of 2, this is worker 0 of 1: resume with the num_workers"):
        next(iter(dataset))


@pytest.mark.parametrize("pack", [None, PackSpec(seq_len=64, rows=2)])
def test_a_dataloader_left_at_its_default_batch_size_says_to_pass_none(server: Server, documents, pack):
    dataset = TokenizedIterableDataset(documents[:50], server.url, batch_size=25, model="uni", pack=pack)
    with pytest.raises(TypeError, match=r"build it with batch_size=None") as refused:
        next(iter(torch.utils.data.DataLoader(dataset)))
    assert "\n" not in str(refused.value)
    with pytest.raises(TypeError, match=r"build it with batch_size=None"):
        next(iter(torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1)))
