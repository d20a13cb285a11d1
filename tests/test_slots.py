"""Shared memory between the pre-tokenizer and its forked workers (tokenizer_service.core.slots): a chunk's texts in,
its ids back, through the same slot; a chunk that does not fit goes through the pipe, with the same ids."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from tokenizer_client.dataset import TokenDataset
from tokenizer_service.core.slots import Slots
from tokenizer_service.core.texts import Utf8Texts


def test_texts_and_ids_go_through_a_slot_and_what_does_not_fit_is_refused():
    slots = Slots(2, text_bytes=16, ids_bytes=40)
    texts = Utf8Texts.of(["x", "héllo", "", "wörld", "y"])[1:4]  # a slice: its bounds do not start at 0
    put = slots.put_texts(1, texts)
    assert put is not None and put.slot == 1 and put.bounds == [0, 6, 6, 12]
    assert list(slots.take_texts(put)) == ["héllo", "", "wörld"]
    assert slots.put_texts(0, Utf8Texts.of(["x" * 17])) is None
    ids = np.arange(10, dtype=np.int32)
    kept = slots.put_ids(1, ids, np.array([0, 4, 10]))
    assert kept is not None and kept.count == 10
    assert list(slots.take_texts(put)) == ["héllo", "", "wörld"]  # the ids' part of a slot is its own
    np.testing.assert_array_equal(slots.take_ids(kept), ids)
    assert slots.put_ids(0, np.arange(11, dtype=np.int32), np.array([0, 11])) is None


def test_slots_the_system_will_not_map_are_none_and_the_run_uses_the_pipes(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmap

    from tokenizer_service.core import slots as slots_module
    from tokenizer_service.tools.pretokenize import main

    def refused(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    source = tmp_path / "in.txt"
    texts = [text for text in documents[:200] if text.strip()]
    source.write_text("\n\n".join(texts) + "\n")
    args = [source, "--local", "--workers", "2", "--model", model_files["uni"], "-q", "--output", tmp_path / "out"]
    with monkeypatch.context() as patched:  # mmap refused while the run starts; the dataset is read after
        patched.setattr(slots_module.mmap, "mmap", refused)
        assert slots_module.shared_slots(4) is None
        assert main([str(arg) for arg in args]) == 0
    sp = spm.SentencePieceProcessor(model_file=str(model_files["uni"]))
    dataset = TokenDataset(tmp_path / "out")
    assert [dataset[index].tolist() for index in range(len(dataset))] == sp.encode(texts, add_eos=True)


def write_in_child(slots: Slots) -> None:
    slots.put_ids(1, np.arange(5, dtype=np.int32) * 3, np.array([0, 5]))


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_process_shares_the_slots_it_inherited():
    slots = Slots(2, text_bytes=16, ids_bytes=64)
    child = multiprocessing.get_context("fork").Process(target=write_in_child, args=(slots,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    from tokenizer_service.core.slots import IdsInSlot

    assert slots.take_ids(IdsInSlot(1, 5, np.array([0, 5]))).tolist() == [0, 3, 6, 9, 12]


@pytest.mark.parametrize("small", ["texts", "ids"])
def test_chunks_too_big_for_a_slot_go_through_the_pipe_with_the_same_ids(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, small: str
):
    """About 3 MB of text, so chunks of about 190 KB (and the document that crosses that), and slots of 200 KiB
    of text: a chunk that holds one of the three 300 KB documents does not fit and travels pickled, the others go
    through the slots. With slots of 100 KiB of ids, most chunks' texts go in through a slot and their ids come
    back pickled. Every document has sentencepiece's ids."""
    source = tmp_path / "in.txt"
    texts: list[str] = []
    for text in (text for text in documents * 50 if text.strip()):
        texts.append(text)
        if sum(map(len, texts)) > 2_100_000:
            break
    for place in (len(texts) // 4, len(texts) // 2, 3 * len(texts) // 4):
        texts[place] = (texts[place].strip() + " ") * (300_000 // len(texts[place]))
    source.write_text("\n\n".join(texts) + "\n")
    out = tmp_path / "out"
    args = [source, "--local", "--workers", "2", "--model", model_files["uni"], "-q", "--output", out]
    # a process of its own, with no other thread: its workers fork (pytest's process may have threads by now)
    ids_bytes = str(100 << 10 if small == "ids" else 400 << 10)
    ran = subprocess.run(
        [sys.executable, "-c", SMALL_SLOTS_RUN, ids_bytes, *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr
    sent = json.loads(ran.stdout.splitlines()[-1])
    assert sent["slot"] > 0 and sent["pipe"] > 0, sent
    if small == "ids":  # ids back through a slot for fewer chunks than went in through one
        assert 0 <= sent["ids in a slot"] < sent["slot"], sent
    else:
        assert sent["ids in a slot"] == sent["slot"], sent
    sp = spm.SentencePieceProcessor(model_file=str(model_files["uni"]))
    dataset = TokenDataset(out)
    assert [dataset[index].tolist() for index in range(len(dataset))] == sp.encode(texts, add_eos=True)


SMALL_SLOTS_RUN = """
import json, sys
from tokenizer_service.core import slots
from tokenizer_service.tools.pretokenize import main

slots.TEXT_BYTES, slots.IDS_BYTES = 200 << 10, int(sys.argv[1])
sent = {"slot": 0, "pipe": 0, "ids in a slot": 0}
put_texts, take_ids = slots.Slots.put_texts, slots.Slots.take_ids

def counted(self, slot, chunk):
    found = put_texts(self, slot, chunk)
    sent["slot" if found is not None else "pipe"] += 1
    return found

def taken(self, ids):
    sent["ids in a slot"] += 1
    return take_ids(self, ids)

slots.Slots.put_texts, slots.Slots.take_ids = counted, taken
code = main(sys.argv[2:])
print(json.dumps(sent))
sys.exit(code)
"""
