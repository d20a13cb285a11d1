"""The fast encoders (fastokens, gigatoken, and tiktoken ranks converted to a tokenizer.json), each behind the gate,
and the rule that picks one per model (tokenizer_service.core.encoders)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from tests.conftest import read_multilingual
from tokenizer_service.core import checkset, encoders, libraries
from tokenizer_service.core.models import find_model_files, tiktoken_ranks
from tokenizer_service.settings import Settings

NON_MERGES = 232  # as many tokens that are no merge of two others as Qwen's ranks hold


def qwen_like(source: Path, directory: Path) -> Path:
    """The tests' ranks with 232 tokens appended that are not the merge of any two tokens (two CJK characters
    that are no tokens themselves, after a space: a whole piece of the split pattern), as Qwen's ranks have."""
    ranks = tiktoken_ranks(source.read_bytes(), source)
    added: list[bytes] = []
    point = 0x4E00
    while len(added) < NON_MERGES:
        first, second = chr(point), chr(point + 1)
        point += 2
        token = f" {first}{second}".encode()
        if any(part.encode() in ranks for part in (first, second, f" {first}")) or token in ranks:
            continue
        if any(token[:cut] in ranks and token[cut:] in ranks for cut in range(1, len(token))):
            continue
        added.append(token)
    sidecar = json.loads(Path(f"{source}.json").read_text())
    count = len(ranks) + len(added)
    sidecar["special_tokens"] = {token: count + index for index, token in enumerate(sidecar["special_tokens"])}
    path = directory / "qwen-like.tiktoken"
    lines = [
        f"{base64.b64encode(raw).decode()} {rank}\n" for raw, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    lines += [f"{base64.b64encode(raw).decode()} {len(ranks) + index}\n" for index, raw in enumerate(added)]
    path.write_text("".join(lines))
    Path(f"{path}.json").write_text(json.dumps(sidecar))
    return path


@pytest.fixture(scope="module")
def qwen_ranks(library_models, tmp_path_factory) -> Path:
    return qwen_like(library_models["tt"], tmp_path_factory.mktemp("qwen-like"))


def non_merge_texts(path: Path) -> list[str]:
    """Texts holding the appended tokens alone, inside prose, and beside special-token strings."""
    ranks = tiktoken_ranks(path.read_bytes(), path)
    tokens = [raw.decode() for raw, rank in ranks.items() if rank >= len(ranks) - NON_MERGES][:40]
    return ["".join(tokens), *[f"Hello{token}, world{token}<|endoftext|>{token}" for token in tokens]]


@pytest.mark.parametrize("route", ["fastokens(converted)", "gigatoken(converted)"])
def test_converted_ranks_give_tiktokens_ids_on_multilingual_text_in_both_modes(qwen_ranks, route):
    files = find_model_files("qwen", qwen_ranks)
    reference = libraries.load(files, libraries.REFERENCE)
    fast = libraries.load(files, route, trusted=True)  # the check set, then this route serves
    assert fast.encoder == route
    texts = read_multilingual() + non_merge_texts(qwen_ranks) + checkset.texts(reference.special)
    for parse in (False, True):
        assert fast.reference_rows(texts, parse) == reference.reference_rows(texts, parse)  # the reference's own
        ids, lengths = fast.encode_plain(texts, parse)
        assert [row.tolist() for row in libraries.flatten_rows(ids, lengths)] == reference.reference_rows(texts, parse)


def test_converted_ranks_pass_the_whole_gate_where_direct_loading_cannot(qwen_ranks, tmp_path, monkeypatch):
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x3000)) + list(range(0x4E00, 0x5000)))
    files = find_model_files("qwen", qwen_ranks)
    library = libraries.load(files, libraries.REFERENCE)
    _fast, differs, route = libraries.gate_verdict(library, encoder="gigatoken")
    assert differs is None and route == "gigatoken(converted)", differs
    verdict = libraries.cached_verdict(libraries.gate_key(files, "gigatoken"))
    assert verdict["encoder"] == "gigatoken(converted)"
    direct = next(c for c in verdict["candidates"] if c["route"] == "gigatoken")
    assert not direct["passed"] and "cannot load it" in direct["differs"]


def genuine_panic(qwen_ranks: Path) -> type[BaseException]:
    """pyo3's PanicException as gigatoken raises it on ranks where some tokens are no merge of two."""
    from gigatoken.gigatoken_rs import BPETokenizer

    try:
        BPETokenizer.from_tiktoken(str(qwen_ranks), "gpt4", None)
    except BaseException as exc:
        assert not isinstance(exc, Exception)
        return type(exc)
    pytest.skip("gigatoken loads these ranks now")


def test_a_panic_at_construction_falls_back_and_is_logged_once(
    qwen_ranks, library_models, tmp_path, monkeypatch, caplog
):
    panic = genuine_panic(qwen_ranks)

    class Panicking:
        def __getattr__(self, name):
            def raising(*args, **kwargs):
                raise panic("called `Option::unwrap()` on a `None` value")

            return raising

    monkeypatch.setattr(libraries, "_gigatoken", lambda: Panicking())
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    with caplog.at_level("WARNING", logger="tokenizer"):
        library = libraries.load(files, "gigatoken", trusted=True)
    assert library.encoder == "tokenizers" and library.fast is None
    lines = [record.getMessage() for record in caplog.records if "gigatoken cannot load it" in record.getMessage()]
    assert len(lines) == 1 and "PanicException" in lines[0], lines
    # with both candidates, the one that panics is refused and the other one serves
    fast, differs, route = libraries.gate_verdict(library, trusted=True)
    assert fast is not None and route == "fastokens", differs


@pytest.mark.parametrize("refused", ["fastokens", "gigatoken"])
def test_a_planted_difference_refuses_that_candidate_only(library_models, tmp_path, monkeypatch, refused):
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x2000)))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    library = libraries.load(files, libraries.REFERENCE)
    build = libraries._build_fast

    def planted(library, route="fastokens"):
        fast, why = build(library, route)
        if fast is not None and encoders.encoder_of(route) == refused:
            fast = libraries._Planted(fast, "\u180e")
        return fast, why

    monkeypatch.setattr(libraries, "_build_fast", planted)
    _fast, differs, route = libraries.gate_verdict(library)
    other = "gigatoken" if refused == "fastokens" else "fastokens"
    assert differs is None and route == other
    verdict = libraries.cached_verdict(libraries.gate_key(files))
    found = {c["route"]: c for c in verdict["candidates"]}
    assert found[other]["passed"] and found[other]["mtps"] > 0 and found[other]["rss_mib"] >= 0
    assert not found[refused]["passed"] and "U+180E" in found[refused]["differs"], found[refused]
    # a later load builds the chosen route from the cached verdict, measuring nothing
    monkeypatch.setattr(libraries, "_try_candidates", lambda *args: pytest.fail("measured again"))
    assert libraries.load(files).encoder == other


def measured(route, mtps, rss, passed=True, load=0.3):
    return {"route": route, "passed": passed, "mtps": mtps, "rss_mib": rss, "load_seconds": load}


def test_the_rule_picks_the_lightest_of_the_quick_to_build_within_a_quarter_of_the_fastest_under_the_bound():
    choose = encoders.choose
    # the fastest by far wins
    assert choose([measured("fastokens", 5.5, 100), measured("gigatoken", 11.0, 150)]) == "gigatoken"
    # within 25%: the lighter one
    assert choose([measured("fastokens", 10.0, 80), measured("gigatoken", 13.0, 150)]) == "fastokens"
    assert choose([measured("fastokens", 96.2, 183), measured("gigatoken", 84.0, 70)]) == "gigatoken"
    assert choose([measured("fastokens", 9.8, 80), measured("gigatoken", 13.2, 150)]) == "gigatoken"  # 26% slower
    # within 25%, but one builds more than 0.25 s slower: the quicker to build (a 128k model on fastokens: 1.9 s)
    assert choose([measured("fastokens", 97.2, 40, load=1.88), measured("gigatoken", 95.4, 98, load=0.39)]) == (
        "gigatoken"
    )
    assert choose([measured("fastokens", 97.2, 40, load=0.6), measured("gigatoken", 95.4, 98, load=0.39)]) == (
        "fastokens"
    )
    # over the memory bound: skipped, unless pinned
    heavy = [measured("fastokens(converted)", 12.0, 545), measured("gigatoken(converted)", 6.0, 188)]
    assert choose(heavy) == "gigatoken(converted)"
    assert choose([measured("fastokens(converted)", 12.0, 545)]) is None
    assert choose([measured("fastokens(converted)", 12.0, 545)], pinned=True) == "fastokens(converted)"
    # refused candidates never; ties broken by memory, then speed, then name; the order given does not matter
    assert choose([measured("gigatoken", 50.0, 10, passed=False), measured("fastokens", 1.0, 10)]) == "fastokens"
    tied = [measured("gigatoken", 10.0, 50), measured("fastokens", 10.0, 50)]
    assert choose(tied) == choose(list(reversed(tied))) == "fastokens"
    assert choose([]) is None


def test_encoder_gigatoken_pins_it(library_models, tmp_path, monkeypatch):
    assert Settings(encoder="gigatoken").encoder == "gigatoken"
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x1000)))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    library = libraries.load(files, libraries.REFERENCE)
    _fast, differs, route = libraries.gate_verdict(library, encoder="gigatoken")
    assert differs is None and route == "gigatoken"
    verdict = libraries.cached_verdict(libraries.gate_key(files, "gigatoken"))
    routes = [c["route"] for c in verdict["candidates"]]  # fastokens was not even tried
    assert routes == ["gigatoken", "gigatoken(ranks)"] and not verdict["candidates"][1]["passed"]  # an added token
    assert libraries.load(files, "gigatoken").encoder == "gigatoken"
    assert libraries.load(files, "fastokens").encoder == "fastokens"
    from tokenizer_service.core.registry import inspect_model

    assert inspect_model("hfbpe", library_models["hfbpe"], "gigatoken").encoder == "gigatoken"


def test_ranks_to_tokenizer_json_is_what_tokenizers_encodes_as_tiktoken_does(qwen_ranks):
    import tokenizers

    files = find_model_files("qwen", qwen_ranks)
    reference = libraries.load(files, libraries.REFERENCE)
    ranks = tiktoken_ranks(files.contents[0], files.main)
    converted = tokenizers.Tokenizer.from_str(
        encoders.ranks_to_tokenizer_json(ranks, reference.spec.pat_str, reference.spec.special_tokens)
    )
    texts = read_multilingual()[:40] + non_merge_texts(qwen_ranks)
    converted.encode_special_tokens = True
    assert [e.ids for e in converted.encode_batch(texts, add_special_tokens=False)] == reference.reference_rows(
        texts, False
    )


# -- what the check set grew with in issue 32's second round --------------------------------------------------


def test_the_check_set_of_ranks_holds_each_token_that_is_no_merge(qwen_ranks):
    files = find_model_files("qwen", qwen_ranks)
    library = libraries.load(files, libraries.REFERENCE)
    ranks = tiktoken_ranks(files.contents[0], files.main)
    found = encoders.non_merges(ranks)
    appended = [raw for raw, rank in ranks.items() if rank >= len(ranks) - NON_MERGES]
    assert set(appended) <= set(found)  # the tests' own, and whatever the trained ranks hold of their own
    texts = libraries.check_texts(library)
    assert all(any(raw.decode() in text for text in texts) for raw in appended)
    alone = {raw.decode() for raw in appended} & set(texts)  # a text that is the token: a whole piece of text
    assert len(alone) >= min(len(appended), checkset.PIECES_PER_TEXT) - len(set(found) - set(appended))


def test_a_conversion_wrong_on_tokens_that_are_no_merge_is_refused_never_served(qwen_ranks, monkeypatch, caplog):
    """Without `ignore_merges` the converted ranks never give a token that is no merge of two (tokie's kind of
    error): the check set's texts of those tokens refuse it, where the check set before them let it through."""
    files = find_model_files("qwen", qwen_ranks)
    reference = libraries.load(files, libraries.REFERENCE)
    convert = encoders.ranks_to_tokenizer_json

    def merges_only(*args):
        document = json.loads(convert(*args))
        document["model"]["ignore_merges"] = False
        return json.dumps(document)

    monkeypatch.setattr(encoders, "ranks_to_tokenizer_json", merges_only)
    wrong, why = libraries._build_fast(reference, "fastokens(converted)")
    assert wrong is not None, why
    rows = libraries._safe_rows(wrong)
    texts = non_merge_texts(qwen_ranks)
    assert rows(texts, False) != reference.reference_rows(texts, False)  # it is wrong on them
    assert libraries.gate("qwen", reference.reference_rows, rows, checkset.texts(reference.special)) is None
    assert libraries.gate("qwen", reference.reference_rows, rows, libraries.check_texts(reference)) is not None
    with caplog.at_level("WARNING", logger="tokenizer"):
        library = libraries.load(files, "fastokens(converted)", trusted=True)
    assert library.encoder == "tiktoken" and library.fast is None
    lines = [record.getMessage() for record in caplog.records if "fastokens(converted) differs" in record.getMessage()]
    assert len(lines) == 1 and "check text" in lines[0], lines


def test_ranks_with_a_gap_are_converted_with_a_hole_fastokens_loads(library_models, tmp_path):
    """fastokens loads a BPE vocabulary only without gaps: an id no token has (a gap in the ranks, a tekken.json's
    special ids) is a HOLE entry that no text reaches."""
    source = library_models["tt"]
    ranks = tiktoken_ranks(source.read_bytes(), source)
    gap = max(ranks.values()) - 10
    lines = [f"{base64.b64encode(raw).decode()} {rank}\n" for raw, rank in ranks.items() if rank != gap]
    path = tmp_path / "gap.tiktoken"
    path.write_text("".join(lines))
    Path(f"{path}.json").write_text(Path(f"{source}.json").read_text())
    files = find_model_files("gap", path)
    document = json.loads(encoders._document(libraries.load(files, libraries.REFERENCE), converted=True))
    assert document["model"]["vocab"][encoders.HOLE.format(id=gap)] == gap
    reference = libraries.load(files, libraries.REFERENCE)
    fast = libraries.load(files, "fastokens(converted)", trusted=True)
    assert fast.encoder == "fastokens(converted)"
    texts = read_multilingual() + checkset.whitespace_texts()
    for parse in (False, True):
        ids, lengths = fast.encode_plain(texts, parse)
        assert [row.tolist() for row in libraries.flatten_rows(ids, lengths)] == reference.reference_rows(texts, parse)


@pytest.mark.parametrize("encoder", ["fastokens", "gigatoken"])
def test_a_panic_at_the_first_encode_falls_back_and_is_logged_once(
    qwen_ranks, library_models, tmp_path, monkeypatch, caplog, encoder
):
    """An encoder that builds, then panics (pyo3's PanicException, no Exception) when it first encodes."""
    panic = genuine_panic(qwen_ranks)

    class Panicking:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            found = getattr(self.inner, name)
            if name in ("encode_batch_flat", "encode_batch", "encode"):  # what encodes (fastokens, gigatoken)

                def raising(*args, **kwargs):
                    raise panic("attempt to subtract with overflow")

                return raising
            if name == "Tokenizer":  # fastokens' class, its constructors wrapped
                return Panicking(found)
            if name in ("from_json_str", "load_hf_json"):  # what builds it (fastokens, gigatoken)
                return lambda *args, **kwargs: BPETokenizer(found(*args, **kwargs))
            return found

    class BPETokenizer(Panicking):  # gigatoken's class name: what encoders.build checks it loaded
        pass

    module = getattr(libraries, f"_{encoder}")()
    monkeypatch.setattr(libraries, f"_{encoder}", lambda: Panicking(module))
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    with caplog.at_level("WARNING", logger="tokenizer"):
        library = libraries.load(files, encoder, trusted=True)
    assert library.encoder == "tokenizers" and library.fast is None
    lines = [record.getMessage() for record in caplog.records if f"{encoder} cannot load it" in record.getMessage()]
    assert len(lines) == 1 and "PanicException" in lines[0], lines


def test_gigatoken_reads_a_binary_bodys_utf8_as_it_reads_str(library_models, tmp_path, monkeypatch):
    """A binary body's texts reach gigatoken as their UTF-8 bytes (`Utf8Texts`, never decoded): the same ids as the
    same texts given as str, in both special-token modes, and the reference library's."""
    from tokenizer_service.core.options import EncodeOptions
    from tokenizer_service.core.texts import Utf8Texts

    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x1000)))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    library = libraries.load(files, "gigatoken")
    reference = libraries.load(files, libraries.REFERENCE)
    assert library.encoder == "gigatoken" and library.takes_utf8 and not reference.takes_utf8
    texts = [*read_multilingual()[:400], "", "<|endoftext|> a<unk>b", "\u00e9\u0301 \U0001f600\r\n\t"]
    as_utf8 = Utf8Texts.of(texts)
    for parse in (False, True):
        options = EncodeOptions(parse_special_tokens=parse)
        got_ids, got_lengths = library.encode(as_utf8, options)
        ids, lengths = library.encode(texts, options)
        want_ids, want_lengths = reference.encode(texts, options)
        assert got_ids.tolist() == ids.tolist() == want_ids.tolist()
        assert got_lengths.tolist() == lengths.tolist() == want_lengths.tolist()


def test_candidates_that_pass_are_raced_side_by_side_in_one_process(library_models, tmp_path, monkeypatch):
    """Their speeds are measured in turns in one fresh process, not each in its own at another moment (a shared
    machine's load moved one by 40% there)."""
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x800)))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    raced = libraries._race_apart(files, ["fastokens", "gigatoken"])
    assert raced is not None and set(raced) == {"fastokens", "gigatoken"}
    assert all(mtps > 0 for mtps in raced.values()), raced
    races = []
    race = libraries._race_apart

    def spied(files, routes):
        races.append(routes)
        return race(files, routes)

    monkeypatch.setattr(libraries, "_race_apart", spied)
    _fast, differs, route = libraries.gate_verdict(libraries.load(files, libraries.REFERENCE))
    assert differs is None and races == [["fastokens", "gigatoken"]]
    verdict = libraries.cached_verdict(libraries.gate_key(files))
    assert route == encoders.choose(verdict["candidates"])


def test_a_tokenizer_json_outline_is_kept_and_its_added_tokens_spliced(library_models, tmp_path, monkeypatch):
    """A start reads a kept outline of the file (its kind, dropout, normalizer, added tokens and where they are
    written) instead of parsing the whole file again; gigatoken gets the file with its special added tokens left
    out by splicing that array, the same document the parse and rewrite gave."""
    from tokenizer_service.core import models

    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_OUTLINES", {})  # none read yet in this process
    original = library_models["hfbpe"] / "tokenizer.json"
    document = json.loads(original.read_text())
    document["added_tokens"].append(  # an ordinary added token is kept, a special one left out
        {"id": len(document["model"]["vocab"]) + 50, "content": "[ordinary]", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": False}
    )  # fmt: skip
    for layout, text in (("compact", json.dumps(document)), ("indented", json.dumps(document, indent=2))):
        content = text.encode()
        parses: list[int] = []

        def counted(content: bytes, parses: list[int] = parses) -> object:
            parses.append(1)
            return json.loads(content)

        monkeypatch.setattr(models, "parsed_json", counted)
        outline = models.json_outline(content)
        assert outline is not None and outline["library"] == models.TOKENIZERS and parses == [1], layout
        assert models.json_outline(content) == outline and parses == [1]  # this process's: not parsed again
        models._OUTLINES.clear()  # as a later process: read from the cache's file
        assert models.json_outline(content) == outline and parses == [1]
        spliced = models.without_special_added_tokens(content, outline)
        assert spliced is not None, layout
        assert json.loads(spliced) == json.loads(encoders.without_special_tokens(text))
        ordinary = [added["content"] for added in document["added_tokens"] if not added["special"]]
        assert [added["content"] for added in json.loads(spliced)["added_tokens"]] == ordinary
        assert "[ordinary]" in ordinary
    # where the array cannot be found as it parsed, no splice: the caller parses and rewrites the file
    assert models.without_special_added_tokens(b"{}", {"span": None, "added_tokens": []}) is None
    assert models._array_span(b'{"added_tokens": [1, 2}', b'"added_tokens"', [1, 2]) is None


def test_a_model_loads_and_its_fast_encoder_builds_without_parsing_it_again(library_models, tmp_path, monkeypatch):
    from tokenizer_service.core import models

    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_OUTLINES", {})  # none read yet in this process
    files = find_model_files("hfbpe", library_models["hfbpe"])  # parses it once, and keeps its outline
    library = libraries.load(files, libraries.REFERENCE)
    gigatoken = libraries._build_fast(library, "gigatoken")[0]
    models.parsed_json.cache_clear()
    models._OUTLINES.clear()  # as a later process: the outline read from the cache's file
    monkeypatch.setattr(models, "parsed_json", lambda content: pytest.fail("parsed again"))
    monkeypatch.setattr(encoders, "parsed_json", lambda content: pytest.fail("parsed again"))
    again = find_model_files("hfbpe", library_models["hfbpe"])
    rebuilt = libraries._build_fast(libraries.HuggingFace(again, libraries.REFERENCE), "gigatoken")[0]
    texts = [*read_multilingual()[:50], "<|endoftext|> as text", "a <tool_call> b"]
    first = libraries._fast_flat(gigatoken, encoders.as_read(gigatoken, texts), False)
    second = libraries._fast_flat(rebuilt, encoders.as_read(rebuilt, texts), False)
    assert first[0].tolist() == second[0].tolist() and first[1].tolist() == second[1].tolist()


# -- a tokenizer.json read as tiktoken ranks (gigatoken(ranks)) ------------------------------------------------


@pytest.fixture(scope="module")
def ranks_like_json(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json laid out as Llama 3's: Llama 3's split pattern, its special tokens after the
    vocabulary (added after training), ids dense from 0."""
    from tests.tokenizer_models import BPE_SPECIAL, byte_level_bpe_without_specials

    tokenizer = byte_level_bpe_without_specials(read_multilingual(), 3000)
    tokenizer.add_special_tokens(BPE_SPECIAL)
    directory = tmp_path_factory.mktemp("as-ranks")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_a_tokenizer_json_read_as_ranks_encodes_as_tokenizers_does_in_both_modes(
    ranks_like_json, tmp_path, monkeypatch
):
    """gigatoken builds tiktoken ranks in half the time it takes to read the same model's JSON: where the merges are
    exactly tiktoken's rank order, the route passes the whole gate and gives tokenizers' ids, special-token strings
    as text and parsed."""
    from gigatoken import gigatoken_rs
    from tokenizers import Tokenizer

    from tests.tokenizer_models import BPE_SPECIAL

    monkeypatch.setenv("TOKENIZER_CACHE_DIR", str(tmp_path))
    files = find_model_files("m", ranks_like_json)
    ranks, scheme = encoders.tokenizer_json_ranks(json.loads(ranks_like_json.read_text()))
    assert scheme == "gpt4" and sorted(ranks.values()) == list(range(len(ranks)))
    library = libraries.HuggingFace(files, encoder="reference")
    fast = encoders.build(library, "gigatoken(ranks)", gigatoken_rs)
    reference = Tokenizer.from_file(str(ranks_like_json))
    texts = read_multilingual()[:300]
    texts += [f"{texts[0][:80]}{BPE_SPECIAL[1]}{texts[1][:80]}", "", " \n\t  ", "x" * 5000]
    for parse_special in (False, True):
        reference.encode_special_tokens = not parse_special
        expected = [row.ids for row in reference.encode_batch(texts, add_special_tokens=False)]
        ids, offsets = fast.encode_batch_flat(texts, split_special_tokens=not parse_special)
        assert [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(texts))] == expected
    found, differs, _ = libraries.gate_verdict(library, encoder="gigatoken(ranks)", trusted=False)
    assert differs is None and found is not None
    verdict = libraries.cached_verdict(libraries.gate_key(files))
    assert verdict is None or any(c["route"] == "gigatoken(ranks)" for c in verdict.get("candidates", []))


def _next_id(document: dict) -> int:
    return 1 + max([*document["model"]["vocab"].values(), *(added["id"] for added in document["added_tokens"])])


def _edited(document: dict, change: str) -> dict:
    document = json.loads(json.dumps(document))
    model = document["model"]
    if change == "merges out of order":
        model["merges"][40], model["merges"][41] = model["merges"][41], model["merges"][40]
    elif change == "special tokens first":
        count = len(document["added_tokens"])
        model["vocab"] = {token: index + count for token, index in model["vocab"].items()}
        for index, added in enumerate(document["added_tokens"]):
            added["id"] = index
    elif change == "a non-special added token":
        document["added_tokens"][0]["special"] = False
    elif change == "another split pattern":
        document["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    elif change == "a normalizer":
        document["normalizer"] = {"type": "NFC"}
    elif change == "a whole token taken by ignore_merges":
        model["vocab"]["ĠXQZ"] = _next_id(document)
        model["ignore_merges"] = True
    return document


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("merges out of order", "not tiktoken's rank order (merge 40"),
        ("special tokens first", "gaps"),
        ("a non-special added token", "non-special added token"),
        ("another split pattern", "no scheme for its split pattern"),
        ("a normalizer", "without a normalizer"),
        ("a whole token taken by ignore_merges", "ignore_merges"),
    ],
)
def test_a_tokenizer_json_that_ranks_would_encode_otherwise_is_refused(ranks_like_json, change, says):
    """Each way tiktoken's reading of the vocabulary could give other ids than the merges is refused, saying which."""
    document = json.loads(ranks_like_json.read_text())
    with pytest.raises(ValueError, match=re.escape(says)):
        encoders.tokenizer_json_ranks(_edited(document, change))


def test_a_token_no_merge_makes_is_left_out_of_the_ranks_when_merges_decide(ranks_like_json):
    """Without ignore_merges, BPE never makes a token that is no merge of two: left out of the ranks, it is never
    made by tiktoken either (a special token in the vocabulary is such a token)."""
    document = json.loads(ranks_like_json.read_text())
    document["model"]["vocab"]["ĠXQZ"] = _next_id(document)
    ranks, _ = encoders.tokenizer_json_ranks(document)
    assert b" XQZ" not in ranks and sorted(ranks.values()) == list(range(len(ranks)))


@pytest.mark.slow  # a server process of its own; .ci/run's slow stage
def test_a_server_serves_a_tokenizer_json_as_ranks_with_tokenizers_ids(ranks_like_json, tmp_path):
    """A verdict that chose gigatoken(ranks): the server's workers build it from the ranks file in the cache, run the
    check set against the library, and answer tokenizers' ids over HTTP; /v1/models names the route."""
    import httpx
    from tokenizers import Tokenizer

    from tests.conftest import start_server, stop_server
    from tests.tokenizer_models import BPE_SPECIAL

    cache_dir = tmp_path / "cache"
    environ = {libraries.CACHE_DIR_ENV: str(cache_dir)}
    files = find_model_files("m", ranks_like_json)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(libraries.CACHE_DIR_ENV, str(cache_dir))
        encoders.json_as_ranks(files)  # the ranks file, as the scan that chose the route wrote it
        measured = {"route": "gigatoken(ranks)", "passed": True, "mtps": 1.0, "rss_mib": 1.0, "load_seconds": 0.01}
        libraries.remember_verdict(libraries.gate_key(files), None, 1.0, "gigatoken(ranks)", [measured])
    url, process = start_server(["--workers", "2", "--model", f"m={ranks_like_json}"], tmp_path / "server.log", environ)
    try:
        (model,) = httpx.get(f"{url}/v1/models", timeout=30).json()["models"]
        assert model["encoder"] == "gigatoken(ranks)", model
        texts = [*read_multilingual()[:200], f"a{BPE_SPECIAL[1]}b", ""]
        reference = Tokenizer.from_file(str(ranks_like_json))
        for parse_special in (False, True):
            reference.encode_special_tokens = not parse_special
            expected = [row.ids for row in reference.encode_batch(texts, add_special_tokens=False)]
            body = {"texts": texts, "model": "m", "parse_special_tokens": parse_special, "add_eos": False}
            answer = httpx.post(f"{url}/v1/tokenize", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["ids"] == expected
    finally:
        stop_server(process)
