"""Prefetch and the torch adapter over conversations and prompt-completion records (issue 31), through a real server
with a chat model: ragged batches carry each conversation's loss mask, packed rows put -100 in ``labels`` wherever
it is 0, every id and mask equal to ``tokenize_conversations`` (``tokenize_records``) one by one, and a run resumed
from any saved state gives exactly the rest of the uninterrupted run.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from tests.chat_models import conversations, write_chat_snapshot
from tests.conftest import start_server, stop_server
from tokenizer_client import AsyncTokenizerClient, PackSpec, PrefetchError, TokenizerClient
from tokenizer_client.packing import IGNORE_INDEX, pack_best_fit, pack_concat

pytest.importorskip("transformers")
from tokenizer_service.core.chat import CATALOGUE

COUNT = 240  # conversations: 200+, multilingual, one to three turns, some with a system prompt or a final user turn


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory, documents: list[str], multilingual: list[str]):
    directory = tmp_path_factory.mktemp("prefetch-chat")
    snapshot = write_chat_snapshot(directory / "chat", documents[:2000] + multilingual)
    args = ["--model", f"chat={snapshot}", "--chat-template", f"chat={CATALOGUE}/qwen3.jinja", "--workers", "2"]
    url, process = start_server(args, directory / "server.log")
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def client(chat_server: str):
    with TokenizerClient(chat_server) as client:
        yield client


@pytest.fixture(scope="module")
def convs(multilingual: list[str]) -> list[list[dict[str, Any]]]:
    return conversations(multilingual, COUNT)


@pytest.fixture(scope="module")
def records(multilingual: list[str]) -> list[dict[str, str]]:
    n = len(multilingual)
    return [{"prompt": multilingual[i % n][:200], "completion": multilingual[(i + 7) % n][:300]} for i in range(210)]


def one_by_one(client: TokenizerClient, items: list[Any], kind: str, **options: Any) -> list[tuple[Any, Any]]:
    """Each conversation (record) in a request of its own: the reference the streams must equal."""
    call = client.tokenize_conversations if kind == "conversations" else client.tokenize_records
    return [call([item], **options)[0] for item in items]


@pytest.fixture(scope="module")
def expected(client, convs) -> list[tuple[np.ndarray, np.ndarray]]:
    return one_by_one(client, convs, "conversations")


@pytest.fixture(scope="module")
def expected_records(client, records) -> list[tuple[np.ndarray, np.ndarray]]:
    return one_by_one(client, records, "records")


def ragged_pairs(batches: list[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [pair for batch in batches for pair in batch.masked_list()]


def assert_pairs_equal(got: list[tuple[np.ndarray, np.ndarray]], want: list[tuple[np.ndarray, np.ndarray]]) -> None:
    assert len(got) == len(want)
    for i, ((ids, mask), (want_ids, want_mask)) in enumerate(zip(got, want, strict=True)):
        assert ids.tolist() == want_ids.tolist(), i
        assert mask.dtype == np.uint8 and mask.tolist() == want_mask.tolist(), i


def concat_reference(pairs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, mask_document_start: bool) -> Any:
    """What concat packing of the whole stream at once gives: the rows and the leftover, with the masks."""
    ids = np.concatenate([p[0] for p in pairs])
    mask = np.concatenate([p[1] for p in pairs])
    offsets = np.concatenate([[0], np.cumsum([len(p[0]) for p in pairs])])
    return pack_concat(ids, offsets, seq_len, mask_document_start=mask_document_start, loss_mask=mask), ids, mask


def stacked(batches: list[Any], name: str) -> np.ndarray:
    return np.concatenate([np.asarray(getattr(batch, name)) for batch in batches])


def states_and_batches(prefetcher: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    batches, states = [], []
    with prefetcher:
        for batch in prefetcher:
            batches.append(batch)
            states.append(prefetcher.state_dict())
    return batches, states


def assert_same_batches(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.index, a.start) == (b.index, b.start)
        if hasattr(a, "input_ids"):
            for name in ("input_ids", "labels", "position_ids"):
                assert np.array_equal(getattr(a, name), getattr(b, name)), name
            assert [row.tolist() for row in a.cu_seqlens] == [row.tolist() for row in b.cu_seqlens]
        else:
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.offsets, b.offsets)
            assert np.array_equal(a.loss_mask, b.loss_mask)


def test_ragged_batches_carry_the_masks_of_tokenize_conversations(client, convs, expected):
    detected = list(client.prefetch(iter(convs), batch_size=16, depth=3))  # a generator: the first item decides
    assert [len(batch) for batch in detected] == [16] * (COUNT // 16) + ([COUNT % 16] if COUNT % 16 else [])
    assert [batch.start for batch in detected] == list(range(0, COUNT, 16))
    assert_pairs_equal(ragged_pairs(detected), expected)
    flagged = list(client.prefetch(convs, batch_size=50, conversations=True, model="chat"))
    assert_pairs_equal(ragged_pairs(flagged), expected)
    assert sum(int(mask.sum()) for _, mask in expected) > 0
    assert all(0 < mask.sum() < mask.size for _, mask in expected)  # never all-trained, never all-masked


def test_train_on_passes_through(client, convs):
    last = ragged_pairs(list(client.prefetch(convs[:60], batch_size=16, train_on="last")))
    assert_pairs_equal(last, one_by_one(client, convs[:60], "conversations", train_on="last"))
    every = one_by_one(client, convs[:60], "conversations")
    multi_turn = [i for i, conv in enumerate(convs[:60]) if sum(m["role"] == "assistant" for m in conv) > 1]
    assert multi_turn and all(last[i][1].sum() < every[i][1].sum() for i in multi_turn)


@pytest.mark.parametrize("mask_document_start", [False, True])
def test_concat_rows_are_the_whole_streams_with_masked_labels(client, convs, expected, mask_document_start):
    seq_len, rows = 256, 4
    spec = PackSpec(seq_len, rows, mask_document_start=mask_document_start)
    with client.prefetch(convs, batch_size=16, depth=3, pack=spec) as prefetcher:
        batches = list(prefetcher)
        leftover, leftover_mask = prefetcher.leftover, prefetcher.leftover_loss_mask
    reference, ids, mask = concat_reference(expected, seq_len, mask_document_start)
    assert all(len(batch) == rows for batch in batches[:-1])
    input_ids, labels = stacked(batches, "input_ids"), stacked(batches, "labels")
    assert np.array_equal(input_ids, reference.input_ids)
    assert np.array_equal(labels, reference.labels)
    assert np.array_equal(stacked(batches, "position_ids"), reference.position_ids)
    cu = [row.tolist() for batch in batches for row in batch.cu_seqlens]
    assert cu == [reference.row_cu_seqlens(r).tolist() for r in range(reference.num_rows)]
    # labels are the ids where the mask is 1, -100 where it is 0 (and, asked for, at each document's start)
    used = input_ids.size
    flat_labels, flat_mask = labels.reshape(-1), mask[:used]
    starts = np.cumsum([0] + [len(p[0]) for p in expected])[:-1]
    row_or_doc = np.zeros(used, bool)
    if mask_document_start:
        row_or_doc[starts[starts < used]] = True
    keep = ~row_or_doc
    assert np.array_equal(flat_labels[keep & (flat_mask == 1)], ids[:used][keep & (flat_mask == 1)])
    assert (flat_labels[flat_mask == 0] == IGNORE_INDEX).all()
    # the tokens that fill no row keep their mask
    assert np.array_equal(leftover, ids[used:]) and np.array_equal(leftover_mask, mask[used:])
    assert np.array_equal(batches[-1].leftover_loss_mask, mask[used:])


def test_best_fit_rows_are_each_requests_packing_with_masked_labels(client, convs, expected):
    seq_len, rows, batch_size = 512, 3, 20
    batches = list(client.prefetch(convs, batch_size=batch_size, depth=3, pack=PackSpec(seq_len, rows, "best_fit")))
    described = client.models()["models"]
    info = next(model for model in described if model["name"] == "chat")
    pad = next((i for i in (info["pad_id"], info["eos_id"]) if i >= 0), 0)
    want_ids, want_labels, want_positions = [], [], []
    for start in range(0, COUNT, batch_size):
        window = expected[start : start + batch_size]
        offsets = np.concatenate([[0], np.cumsum([len(p[0]) for p in window])])
        packed = pack_best_fit(
            np.concatenate([p[0] for p in window]),
            offsets,
            seq_len,
            pad_id=pad,
            loss_mask=np.concatenate([p[1] for p in window]),
        )
        want_ids.append(packed.input_ids)
        want_labels.append(packed.labels)
        want_positions.append(packed.position_ids)
    assert all(len(batch) == rows for batch in batches[:-1])
    assert np.array_equal(stacked(batches, "input_ids"), np.concatenate(want_ids))
    assert np.array_equal(stacked(batches, "labels"), np.concatenate(want_labels))
    assert np.array_equal(stacked(batches, "position_ids"), np.concatenate(want_positions))
    # every token of every conversation is in a row once, its label the id where the mask is 1, else -100
    got_pieces = sorted(
        (tuple(batch.input_ids[r, a:b].tolist()), tuple(batch.labels[r, a:b].tolist()))
        for batch in batches
        for r, cu in enumerate(batch.cu_seqlens)
        for a, b in itertools.pairwise(cu.tolist())
    )
    want_pieces = sorted(
        (tuple(ids[a : a + seq_len].tolist()), tuple(np.where(mask == 1, ids, IGNORE_INDEX)[a : a + seq_len].tolist()))
        for ids, mask in expected
        for a in range(0, len(ids), seq_len)
    )
    assert got_pieces == want_pieces


@pytest.mark.parametrize("mode", ["ragged", "concat", "best_fit"])
def test_resume_mid_stream_gives_exactly_the_rest(client, convs, mode):
    pack = None if mode == "ragged" else PackSpec(192, 2, mode)
    options: dict[str, Any] = {"batch_size": 12, "depth": 3, "pack": pack}
    whole, states = states_and_batches(client.prefetch(convs, **options))
    assert len(whole) > 10
    for cut in (0, 3, len(whole) // 2, len(whole) - 2):
        assert states[cut]["options"]["inputs"] == "conversations"
        rest = list(client.prefetch(iter(convs), state=states[cut], **options))
        assert_same_batches(rest, whole[cut + 1 :])
    if mode == "concat":  # concat rows cut conversations: some states stop inside one, and resume there
        assert any(state["skip"] > 0 for state in states)
        inside = next(i for i, state in enumerate(states) if state["skip"] > 0)
        assert_same_batches(list(client.prefetch(convs, state=states[inside], **options)), whole[inside + 1 :])


def test_resume_on_another_stream_is_refused_by_the_conversations_fingerprint(client, convs):
    options: dict[str, Any] = {"batch_size": 12, "pack": PackSpec(192, 2)}
    _, states = states_and_batches(client.prefetch(convs[:80], **options))
    state = states[2]
    checked = state["last_text"]["text"]
    changed = [list(conv) for conv in convs[:80]]
    changed[checked] = [*changed[checked][:-1], {**changed[checked][-1], "content": "something else"}]
    with pytest.raises(ValueError, match=rf"its conversation {checked} .* not the conversation the saved run read"):
        next(iter(client.prefetch(changed, state=state, **options)))
    # the same conversation with its keys in another order is the same conversation (canonical JSON)
    reordered = [list(conv) for conv in convs[:80]]
    reordered[checked] = [dict(reversed(list(message.items()))) for message in reordered[checked]]
    assert list(client.prefetch(reordered, state=state, **options))
    # a texts state does not resume a conversations stream, and the options named say why
    with pytest.raises(ValueError, match="inputs"):
        client.prefetch(convs, state=state, **{**options, "conversations": False})


def test_records_ragged_packed_and_resumed(client, records, expected_records):
    assert_pairs_equal(ragged_pairs(list(client.prefetch(records, batch_size=32))), expected_records)
    flagged = list(client.prefetch(iter(records), batch_size=32, records=True))
    assert_pairs_equal(ragged_pairs(flagged), expected_records)
    seq_len = 128
    options: dict[str, Any] = {"batch_size": 16, "depth": 2, "pack": PackSpec(seq_len, 4)}
    whole, states = states_and_batches(client.prefetch(records, **options))
    reference, _, _ = concat_reference(expected_records, seq_len, False)
    assert np.array_equal(stacked(whole, "input_ids"), reference.input_ids)
    assert np.array_equal(stacked(whole, "labels"), reference.labels)
    assert states[0]["options"]["inputs"] == "records" and "train_on" not in states[0]["options"]
    cut = len(whole) // 2
    assert_same_batches(list(client.prefetch(iter(records), state=states[cut], **options)), whole[cut + 1 :])


def test_async_prefetch_of_conversations(chat_server, convs, expected):
    async def run() -> tuple[list[Any], list[Any]]:
        async with AsyncTokenizerClient(chat_server) as client:
            detected = [batch async for batch in client.prefetch(convs, batch_size=30)]

            async def source():
                for conv in convs:
                    yield conv

            packed = [b async for b in client.prefetch(source(), conversations=True, pack=PackSpec(256, 4))]
        return detected, packed

    detected, packed = asyncio.run(run())
    assert_pairs_equal(ragged_pairs(detected), expected)
    reference, _, _ = concat_reference(expected, 256, False)
    assert np.array_equal(stacked(packed, "labels"), reference.labels)


def test_options_that_conversations_cannot_take_are_refused_at_the_call(client, convs):
    with pytest.raises(ValueError, match="add_bos, add_eos, max_length and sample cannot be used with conversations"):
        client.prefetch(convs, pack=PackSpec(64, 2, add_eos=True))
    with pytest.raises(ValueError, match="cannot be used with conversations"):
        client.prefetch(convs, max_length=10)
    with pytest.raises(ValueError, match="train_on applies to conversations only"):
        client.prefetch(["a text"], train_on="last")
    with pytest.raises(TypeError, match=r"text 0 is a list, not a str; conversations are lists of message dicts"):
        next(iter(client.prefetch(convs, conversations=False)))
    with pytest.raises(TypeError, match=r"conversation 1 is a str, not a list of messages"):
        next(iter(client.prefetch([convs[0], "a text"], batch_size=4)))


def test_a_texts_state_keeps_the_options_states_had_before_conversations(client, multilingual):
    """States saved before conversations came have no inputs or train_on: a texts prefetch still resumes them."""
    texts = multilingual[:60]
    whole, states = states_and_batches(client.prefetch(texts, batch_size=8, pack=PackSpec(64, 2)))
    assert not {"inputs", "train_on"} & set(states[3]["options"])
    assert_same_batches(list(client.prefetch(texts, batch_size=8, pack=PackSpec(64, 2), state=states[3])), whole[4:])


def test_the_torch_adapter_packs_conversations_and_resumes(chat_server, convs, expected):
    torch = pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from tokenizer_client.torch_data import TokenizedIterableDataset

    seq_len = 256
    dataset = TokenizedIterableDataset(lambda: iter(convs), chat_server, batch_size=16, pack=PackSpec(seq_len, 4))
    loader = stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=0)
    whole, states = [], []
    for batch in loader:
        assert isinstance(batch.labels, torch.Tensor)
        whole.append(batch)
        states.append(loader.state_dict())
    reference, _, _ = concat_reference(expected, seq_len, False)
    assert np.array_equal(np.concatenate([b.labels.numpy() for b in whole]), reference.labels)
    assert np.array_equal(np.concatenate([b.input_ids.numpy() for b in whole]), reference.input_ids)
    cut = len(whole) // 3
    resumed = stateful.StatefulDataLoader(
        TokenizedIterableDataset(lambda: iter(convs), chat_server, batch_size=16, pack=PackSpec(seq_len, 4)),
        batch_size=None,
        num_workers=0,
    )
    resumed.load_state_dict(states[cut])
    rest = list(resumed)
    assert [b.index for b in rest] == [b.index for b in whole[cut + 1 :]]
    assert all(torch.equal(a.labels, b.labels) for a, b in zip(rest, whole[cut + 1 :], strict=True))


def test_a_refused_conversation_is_named_by_its_stream_index(client, convs):
    broken = [list(conv) for conv in convs[:60]]
    broken[37] = [{"content": "no role"}, *broken[37]]
    with pytest.raises(PrefetchError) as raised:
        list(client.prefetch(broken, batch_size=16, pack=PackSpec(128, 2)))
    error = raised.value
    assert (error.text_start, error.text_stop, error.text_index) == (32, 48, 37)
    assert "conversations 32 to 47" in str(error) and "role" in str(error)


def test_the_torch_adapters_ragged_batches_carry_the_mask_as_a_tensor(chat_server, convs, expected):
    torch = pytest.importorskip("torch")
    from tokenizer_client.torch_data import TokenizedIterableDataset

    dataset = TokenizedIterableDataset(lambda: convs[:48], chat_server, batch_size=16, train_on="assistant")
    batches = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0))
    assert all(batch.loss_mask.dtype == torch.uint8 for batch in batches)
    got = [(np.asarray(ids), np.asarray(mask)) for b in batches for ids, mask in b.masked_list()]
    assert_pairs_equal(got, expected[:48])
