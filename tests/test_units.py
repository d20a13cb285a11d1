"""Pure pieces without a server: the wire format, request chunking, truncation, settings."""

from __future__ import annotations

import itertools
import unicodedata
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_client import wire
from tokenizer_service.core.handler import DECOMPOSING_BELOW, NFKC_MAX_GROWTH, chunk_bounds, growth_bound
from tokenizer_service.core.libraries import frame, truncate
from tokenizer_service.settings import BUNDLED_MODELS_DIR, ConfigError, Settings


@given(lengths=st.lists(st.integers(0, 50), max_size=30), extra=st.integers(0, 1000))
def test_wire_round_trip(lengths, extra):
    offsets = wire.ragged_offsets(np.array(lengths, dtype=np.int64))
    ids = np.arange(offsets[-1], dtype=np.int32) - extra
    matrix = np.arange(6, dtype=np.int32).reshape(2, 3)
    frame = wire.decode(wire.encode({"ids": ids, "offsets": offsets, "m": matrix}, {"model": "x", "n": len(lengths)}))
    assert frame.meta == {"model": "x", "n": len(lengths)}
    np.testing.assert_array_equal(frame["ids"], ids)
    np.testing.assert_array_equal(frame["offsets"], offsets)
    np.testing.assert_array_equal(frame["m"], matrix)
    assert [row.tolist() for row in wire.split_ragged(frame["ids"], frame["offsets"])] == [
        ids[a:b].tolist() for a, b in itertools.pairwise(offsets)
    ]


def test_wire_layout_is_little_endian_and_aligned():
    big_endian = np.array([1, 2, 3], dtype=">i4")
    buffer = wire.encode({"a": np.array([7], dtype=np.int64), "b": big_endian})
    assert buffer[:4] == b"TKNA"
    frame = wire.decode(buffer)
    assert frame["b"].dtype == np.dtype("<i4") and frame["b"].tolist() == [1, 2, 3]
    header_length = int.from_bytes(buffer[8:12], "little")
    data_start = -(-(12 + header_length) // 8) * 8
    assert int.from_bytes(buffer[data_start : data_start + 8], "little") == 7
    assert not frame["a"].flags.owndata  # read in place


@pytest.mark.parametrize(
    ("buffer", "message"),
    [
        (b"", "shorter"),
        (b"XXXX" + bytes(8), "magic"),
        (b"TKNA\x02\x00\x00\x00" + bytes(4), "version"),
        (b"TKNA\x01\x00\x00\x00\xff\x00\x00\x00{}", "truncated"),
        (b"TKNA\x01\x00\x00\x00\x02\x00\x00\x00{]", "header"),
    ],
)
def test_wire_rejects_malformed_frames(buffer, message):
    with pytest.raises(wire.WireFormatError, match=message):
        wire.decode(buffer)


def _frame(header: dict, data: bytes = bytes(8)) -> bytes:
    encoded = orjson.dumps(header)
    head = b"TKNA\x01\x00\x00\x00" + len(encoded).to_bytes(4, "little") + encoded
    return head + bytes(-len(head) % 8) + data


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"meta": {}, "arrays": None}, "not a list"),
        ({"meta": {}, "arrays": 5}, "not a list"),
        ({"meta": {}, "arrays": [{"name": "texts", "dtype": ["|u1"], "shape": [1], "offset": 0}]}, "descriptor"),
        ({"meta": {}, "arrays": [{"name": "texts", "dtype": {"a": 1}, "shape": [1], "offset": 0}]}, "descriptor"),
        ({"meta": {}, "arrays": [{"name": "texts", "dtype": "|u1", "shape": [1] * 65, "offset": 0}]}, "descriptor"),
    ],
)
def test_wire_rejects_headers_of_the_wrong_shape(header, message):
    """What a hostile client put in a frame's header is a WireFormatError (a 400), never another exception (a 500)."""
    with pytest.raises(wire.WireFormatError, match=message):
        wire.decode(_frame(header))


def test_wire_rejects_truncated_array():
    buffer = wire.encode({"ids": np.arange(100, dtype=np.int32)})
    with pytest.raises(wire.WireFormatError, match="truncated inside array"):
        wire.decode(buffer[:-8])


@given(sizes=st.lists(st.integers(0, 5000), max_size=200), max_chunks=st.integers(1, 16), minimum=st.integers(1, 20000))
def test_chunks_cover_the_request_in_order(sizes, max_chunks, minimum):
    bounds = chunk_bounds(np.array(sizes, dtype=np.int64), max_chunks, minimum)
    if not sizes:
        assert bounds == []
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
    assert len(bounds) <= max_chunks
    if len(bounds) > 1:
        assert sum(sizes) >= minimum * len(bounds)


def test_truncate_keeps_eos_last():
    ids = np.array([1, 10, 11, 12, 2], dtype=np.int32)
    one = np.array([5], dtype=np.int64)
    assert truncate(ids, one, 3, eos=2)[0].tolist() == [1, 10, 2]
    assert truncate(ids, one, 3, eos=None)[0].tolist() == [1, 10, 11]
    assert truncate(ids, one, 0, eos=2)[0].tolist() == []
    assert truncate(ids, one, 9, eos=2)[0].tolist() == ids.tolist()


@given(
    rows=st.lists(st.lists(st.integers(3, 1000), max_size=12), max_size=20),
    bos=st.sampled_from([None, 1]),
    eos=st.sampled_from([None, 2]),
    max_length=st.one_of(st.none(), st.integers(0, 14)),
)
def test_flat_framing_equals_framing_each_text(rows, bos, eos, max_length):
    """BOS/EOS and max_length on a flat batch give what adding them to each text on its own gives."""
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    ids = np.array([token for row in rows for token in row], dtype=np.int32)
    ids, lengths = frame(ids, lengths, bos, eos)
    if max_length is not None:
        ids, lengths = truncate(ids, lengths, max_length, eos)
    expected = []
    for row in rows:
        row = ([bos] if bos is not None else []) + row + ([eos] if eos is not None else [])
        if max_length is not None and len(row) > max_length:
            row = [*row[: max_length - 1], eos] if eos is not None and max_length > 0 else row[:max_length]
        expected.append(row)
    offsets = wire.ragged_offsets(lengths)
    assert [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(rows))] == expected
    assert ids.dtype == np.int32 and lengths.dtype == np.int64


def test_settings_from_flags_and_environment(monkeypatch, tmp_path):
    (tmp_path / "alpha.model").write_bytes(b"")
    (tmp_path / "beta.model").write_bytes(b"")
    settings = Settings(
        _cli_parse_args=["--models-dir", str(tmp_path), "--model", "gamma=/m/g.model", "--workers", "3"]
    )
    assert settings.workers == 3
    assert settings.model_paths() == {
        "alpha": tmp_path / "alpha.model",
        "beta": tmp_path / "beta.model",
        "gamma": Path("/m/g.model"),
    }
    monkeypatch.setenv("TOKENIZER_MODEL", "a=/x.model,b=/y.model")
    monkeypatch.setenv("TOKENIZER_MAX_TEXTS", "12")
    from_env = Settings()
    assert from_env.model == ["a=/x.model", "b=/y.model"] and from_env.max_texts == 12


def test_a_models_directory_serves_every_kind_under_its_name(tmp_path):
    (tmp_path / "sp.model").write_bytes(b"")
    (tmp_path / "qwen.tiktoken").write_bytes(b"")
    (tmp_path / "qwen.tiktoken.json").write_text("{}")  # a sidecar, not a model
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "tokenizer.json").write_text("{}")
    (tmp_path / "empty").mkdir()  # a directory without tokenizer.json: not a model
    (tmp_path / "notes.txt").write_text("")
    settings = Settings(_cli_parse_args=["--models-dir", str(tmp_path)])
    assert settings.model_paths() == {
        "llama3": tmp_path / "llama3",
        "qwen": tmp_path / "qwen.tiktoken",
        "sp": tmp_path / "sp.model",
    }
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="two models named 'sp'"):
        settings.model_paths()


def test_settings_default_to_the_bundled_model(monkeypatch):
    monkeypatch.delenv("TOKENIZER_MODEL", raising=False)
    monkeypatch.delenv("TOKENIZER_MODELS_DIR", raising=False)
    assert Settings().model_paths() == {"default": BUNDLED_MODELS_DIR / "default.model"}


def test_settings_reject_a_bad_model_spec():
    with pytest.raises(ValueError, match="NAME=PATH"):
        Settings(model=["no-equals-sign"])


def test_admission_counts_bytes_and_refuses_beyond_the_budget():
    from tokenizer_service.core.errors import Overloaded
    from tokenizer_service.http.admission import Admission
    from tokenizer_service.metrics import Metrics

    admission = Admission(limit=100, metrics=Metrics())
    admission.admit(500)  # an idle server takes any request the body limit allows
    with pytest.raises(Overloaded, match="500 bytes of requests are waiting"):
        admission.admit(1)
    admission.release(500)
    admission.admit(60)
    admission.admit(40)
    with pytest.raises(Overloaded):
        admission.admit(1)
    admission.release(100)
    assert admission.queued == 0


def client_import_graph() -> dict[str, set[str]]:
    """Imports between the modules of client/ and its subpackages, function-level and ``if TYPE_CHECKING:`` ones
    included; importing ``tokenizer_client.prefetch.rows`` imports the package ``client.prefetch`` too."""
    import ast

    package = Path(__file__).resolve().parent.parent / "client"

    def module_name(path: Path) -> str:
        parts = ("tokenizer_client", *path.relative_to(package).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {module_name(path): path for path in package.rglob("*.py")}

    def with_packages(module: str, importer: str) -> list[str]:
        """`module` and the subpackages of tokenizer_client it lies in: not tokenizer_client itself
        (its imports are all lazy), nor a package the importer lies in (Python has begun importing that one before
        the importer runs)."""
        parts = module.split(".")
        names = [".".join(parts[:end]) for end in range(2, len(parts) + 1)]
        return [name for name in names if name == module or not importer.startswith(f"{name}.")]

    def imported(node: ast.AST, name: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if isinstance(node, ast.ImportFrom):
            here = name.split(".") if modules[name].name == "__init__.py" else name.split(".")[:-1]
            prefix = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            base = ".".join(part for part in (prefix, node.module or "") if part)
            return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        return []

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        nodes: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
        while nodes:
            node = nodes.pop()
            for module in imported(node, name):
                edges.update(part for part in with_packages(module, name) if part in modules)
                if module == "tokenizer_client":
                    edges.add(module)
            nodes.extend(ast.iter_child_nodes(node))
        edges.discard(name)
        graph[name] = edges
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its modules in import order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for child in sorted(graph[node]):
            if child in path:
                return [*path[path.index(child) :], child]
            if child not in done and (cycle := visit(child)):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def test_client_modules_import_each_other_without_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    graph = client_import_graph()
    assert "tokenizer_client.torch_data" in graph["tokenizer_client"], "function-level imports count"
    assert {"tokenizer_client._base", "tokenizer_client.prefetch"} <= graph["tokenizer_client.clients"]
    prefetch = [name for name in graph if name.startswith("tokenizer_client.prefetch")]
    for name in prefetch:
        assert not graph[name] & {"tokenizer_client.clients", "tokenizer_client._base"}, f"{name} knows no client class"
    assert not graph["tokenizer_client._torch"], "tokenizer_client._torch knows arrays only"
    assert not graph["tokenizer_client._base"] & {"tokenizer_client.clients", "tokenizer_client.prefetch"}, (
        "the I/O-free base knows no I/O class"
    )
    assert not graph["tokenizer_client._outage"] & {"tokenizer_client._base", "tokenizer_client.clients"}
    cycle = import_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_request_bodies_send_flags_as_json_booleans_and_leave_defaults_out():
    from tokenizer_client._requests import PackOptions, TokenizeOptions

    assert TokenizeOptions(add_bos=np.True_, add_eos=0).payload(("a",)) == {"texts": ["a"], "add_bos": True}
    assert TokenizeOptions("m", max_length=0, sample={}).payload(["a"]) == {
        "texts": ["a"],
        "model": "m",
        "max_length": 0,
        "sample": {},
    }
    assert PackOptions(8).payload(["a"], carry=np.array([1, 2], np.int32)) == {
        "texts": ["a"],
        "seq_len": 8,
        "strategy": "concat",
        "add_bos": False,
        "add_eos": True,
        "mask_document_start": False,
        "carry": [1, 2],
    }


def test_ids_for_detokenize_in_every_shape_a_caller_has_them():
    from tokenizer_client._inputs import id_rows

    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.array([1, 2]), [3]
    assert id_rows(ragged) == [[1, 2], [3]]
    assert id_rows(np.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert id_rows([np.array([1]), (2, 3), [np.int64(4)]]) == [[1], [2, 3], [np.int64(4)]]
    assert id_rows(np.empty(0, np.int32)) == []
    assert id_rows(row for row in [[5]]) == [[5]]


@pytest.mark.parametrize("timeout", [None, 30, 2.5, np.float32(1.0)])
def test_every_timeout_httpx_takes_is_taken(timeout):
    import httpx

    from tokenizer_client import TokenizerClient

    TokenizerClient("http://127.0.0.1:1", timeout=timeout).close()
    TokenizerClient("http://127.0.0.1:1", timeout=httpx.Timeout(5.0)).close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "", "::1"])
def test_an_address_uvicorn_can_listen_on_passes_the_start_check(host):
    from tokenizer_service.cli import check_address
    from tokenizer_service.tools.launcher import free_port

    assert check_address(host, free_port()) is None


@pytest.mark.parametrize("host", ["not..a..host", "a" * 64 + ".example"])
def test_a_host_that_is_no_name_is_one_line_not_a_traceback(host):
    """The idna codec raises UnicodeError (not gaierror) for an empty label or one over 63 characters."""
    from tokenizer_service.cli import check_address
    from tokenizer_service.tools.launcher import free_port

    problem = check_address(host, free_port())
    assert problem is not None and "is no host name nor address" in problem


def test_the_expansion_bounds_constants_hold_for_every_code_point():
    """NFKC grows no character's UTF-8 more than 11-fold, and nothing at or above U+30000 decomposes."""
    for point in range(0x110000):
        if 0xD800 <= point <= 0xDFFF:
            continue
        char = chr(point)
        if point >= DECOMPOSING_BELOW:
            assert not unicodedata.decomposition(char), hex(point)
            continue
        size = len(char.encode())
        assert len(unicodedata.normalize("NFKC", char).encode()) <= NFKC_MAX_GROWTH * size, hex(point)


COMPATIBILITY = "\ufdfa\u3300\ufb01\u00a0\u2026\uff21\u1e9b\u0323\u0301e\uac00\u1100\u1161\u2460\u33ff\U0001d400"


@given(st.text(alphabet=st.sampled_from(COMPATIBILITY) | st.characters(exclude_categories=["Cs"]), max_size=60))
def test_the_per_character_bound_is_never_below_what_nfkc_adds(text):
    grown = len(unicodedata.normalize("NFKC", text).encode()) - len(text.encode())
    assert growth_bound([text]) >= grown
    assert growth_bound([text, text]) == 2 * growth_bound([text])


def test_readiness_is_one_state_the_gauge_follows():
    from tokenizer_service.core.readiness import Readiness, ServiceState
    from tokenizer_service.metrics import Metrics

    class Pool:  # what ServiceState reads of a WorkerPool: `ready`, and the `on_change` it sets
        ready = True
        on_change = None

    metrics, pool = Metrics(), Pool()
    state = ServiceState(metrics)

    def gauge() -> float:
        return metrics.ready._value.get()

    assert state.readiness is Readiness.STARTING and state.phase is Readiness.STARTING and gauge() == 0
    state.serving(pool)  # type: ignore[arg-type]
    assert state.readiness is Readiness.READY and gauge() == 1
    pool.ready = False
    pool.on_change()  # the pool says its workers changed
    assert state.readiness is Readiness.REBUILDING and state.phase is Readiness.READY and gauge() == 0
    pool.ready = True
    pool.on_change()
    assert state.readiness is Readiness.READY and gauge() == 1
    state.stopping()
    assert state.readiness is Readiness.STOPPING and gauge() == 0


@pytest.mark.parametrize("algorithm", ["bpe", "unigram", "wordpiece", "wordlevel"])
def test_a_tokenizer_jsons_vocabulary_size_is_read_from_the_document_as_the_library_counts_it(algorithm):
    """hf_vocab_size reads the parsed file instead of building the library's vocabulary dict: the same number as
    max(get_vocab(with_added_tokens=True)) + 1, with added tokens past the model's ids, inside them, and a gap."""
    import orjson
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tokenizer_service.core.models import hf_vocab_size

    texts = [unicodedata.normalize("NFC", f"text {i} of {chr(0x4E00 + i)} words, and {i * 7} more") for i in range(300)]
    model, trainer = {
        "bpe": (models.BPE(), trainers.BpeTrainer(vocab_size=300)),
        "unigram": (
            models.Unigram(),
            trainers.UnigramTrainer(vocab_size=600, unk_token="[UNK]", special_tokens=["[UNK]"]),
        ),
        "wordpiece": (models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(special_tokens=["[UNK]"])),
        "wordlevel": (models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer(special_tokens=["[UNK]"])),
    }[algorithm]
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(["<|end|>", "<|pad|>"])
    document = orjson.loads(tokenizer.to_str())
    variants = [document]
    gap = orjson.loads(tokenizer.to_str())
    gap["added_tokens"][-1]["id"] += 40  # an added token past a gap
    variants.append(gap)
    inside = orjson.loads(tokenizer.to_str())
    inside["added_tokens"] = inside["added_tokens"][:1]
    inside["added_tokens"][0]["id"] = 3  # an added token with an id the model has
    variants.append(inside)
    for variant in variants:
        loaded = Tokenizer.from_str(orjson.dumps(variant).decode())
        expected = max(loaded.get_vocab(with_added_tokens=True).values()) + 1
        assert hf_vocab_size(variant, loaded) == expected


# -- a binary body's texts as UTF-8 (tokenizer_service.core.texts) ------------------------------------------


def test_utf8_texts_read_slice_and_pickle_as_a_list_of_str():
    import pickle

    from tokenizer_service.core.texts import Utf8Texts, text_sizes

    texts = ["", "a", "\u00e9t\u00e9", "\U0001f600", "", "z\n"]
    held = Utf8Texts.of(texts)
    assert list(held) == texts and len(held) == 6 and held == texts and held[-1] == "z\n" and held[2] == "\u00e9t\u00e9"
    assert held[1:4] == texts[1:4] and held[4:2] == [] and held[::2] == texts[::2]
    assert held.utf8() == [text.encode() for text in texts] and text_sizes(held).tolist() == [0, 1, 5, 4, 0, 2]
    assert text_sizes(texts).tolist() == [0, 1, 3, 1, 0, 2]  # a list of str: characters
    part = pickle.loads(pickle.dumps(held[2:4]))
    assert part == texts[2:4] and part.data == "\u00e9t\u00e9\U0001f600".encode()  # only its own bytes travel
    with pytest.raises(IndexError):
        held[6]


@pytest.mark.parametrize(
    "text",
    [
        b"\xed\xa0\x80",  # a surrogate (U+D800)
        b"\xed\x9f\xbf",  # U+D7FF, the last code point before them
        b"\xc0\xaf",  # overlong '/'
        b"\xe0\x80\xaf",  # overlong, 3 bytes
        b"\xf0\x8f\xbf\xbf",  # overlong, 4 bytes
        b"\xf4\x8f\xbf\xbf",  # U+10FFFF
        b"\xf4\x90\x80\x80",  # past U+10FFFF
        b"\xf5\x80\x80\x80",
        b"\xef\xbf\xbe",  # U+FFFE, a noncharacter: valid UTF-8
        b"ab\xe2\x82",  # cut short
        b"\x80",  # a lone continuation byte
        b"\x00",
    ],
)
def test_utf8_check_refuses_what_python_refuses(text):
    """The frame check (Arrow's, and the decoder's where pyarrow is not installed) and Python's decoder agree on each
    class of ill-formed UTF-8, alone and between two valid texts."""
    from tokenizer_service.core.texts import _all_decode, all_valid

    try:
        text.decode("utf-8")
        expected = True
    except UnicodeDecodeError:
        expected = False
    around = "é".encode() + text + "文".encode()
    for check in (all_valid, _all_decode):
        assert check(text, np.array([0, len(text)], dtype=np.int64)) is expected
        assert check(around, np.array([0, 2, 2 + len(text), len(around)], dtype=np.int64)) is expected


@settings(max_examples=400, deadline=None)
@given(
    st.binary(max_size=40), st.lists(st.integers(0, 40), max_size=6), st.sampled_from([b"", b"\xc3\xa9", b"\xf0\x9f"])
)
def test_utf8_texts_check_says_what_decoding_each_text_says(data, cuts, middle):
    """`all_valid` on the whole buffer agrees with decoding each text on its own, sequences cut between two texts
    included; a refused frame names the first text that does not decode."""
    from tokenizer_client import wire
    from tokenizer_service.core.errors import InvalidField
    from tokenizer_service.core.requests import TokenizeRequest, parse_request
    from tokenizer_service.core.texts import _all_decode, all_valid

    data = data[:20] + middle + data[20:]
    bounds = [0, *sorted(min(cut, len(data)) for cut in cuts), len(data)]
    offsets = np.array(bounds, dtype=np.int64)

    def decodes(index: int) -> bool:
        try:
            data[bounds[index] : bounds[index + 1]].decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    valid = [decodes(index) for index in range(len(bounds) - 1)]
    assert all_valid(data, offsets) == all(valid)
    assert _all_decode(data, offsets) == _all_decode(data, offsets, window=3) == all(valid)  # without pyarrow
    body = wire.encode({"texts": np.frombuffer(data, dtype=np.uint8), "offsets": offsets}, {})
    if all(valid):
        assert parse_request(body, TokenizeRequest, "texts", 100).texts == [
            data[bounds[i] : bounds[i + 1]].decode() for i in range(len(bounds) - 1)
        ]
    else:
        with pytest.raises(InvalidField) as raised:
            parse_request(body, TokenizeRequest, "texts", 100)
        assert raised.value.index == valid.index(False)


def test_a_chunk_travels_as_utf8_whatever_its_texts_came_as():
    from tokenizer_service.core.texts import Utf8Texts, as_utf8

    texts = ["h\u00e9", memoryview("\u4e16\u754c".encode()), b"ok"]
    sent = as_utf8(texts)
    assert isinstance(sent, Utf8Texts) and list(sent) == ["h\u00e9", "\u4e16\u754c", "ok"]
    # a lone surrogate cannot be UTF-8: str all, for the encoder to refuse as it would have
    assert as_utf8(["a", memoryview(b"b"), "\ud800"]) == ["a", "b", "\ud800"]
