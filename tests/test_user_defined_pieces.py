"""SentencePiece's USER_DEFINED pieces (issue 36, item 10): matched in any text, as the library does.

Mistral's v7 `.model` has 22 of them (`[INST]`, `[REF]`, ...): sentencepiece encodes `"[REF]"` in a text
as its id whatever `parse_special_tokens` says, and never matches a CONTROL piece (`<s>`) in text. The ids
stay the library's; `/v1/models` says which pieces match (`user_defined_pieces`), as docs/api.md does.
The model is trained here with `user_defined_symbols` and `control_symbols`.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import sentencepiece as spm

from tests.conftest import DATA
from tests.test_edge_inprocess import Edge
from tokenizer_service.core.models import ModelInfo
from tokenizer_service.core.registry import inspect_model

USER_DEFINED = ["[INST]", "[/INST]", "[REF]", "<tool_call>"]
CONTROL = ["<ctl>"]
TEXTS = [
    "[INST] Who wrote Botchan? [/INST] Natsume Soseki [REF] 1906",
    "a[REF]b and <tool_call>{} and <ctl> and <s> as text",
    "no piece here",
]


@pytest.fixture(scope="module")
def user_defined_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = [line for line in (DATA / "botchan.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines[:3000]),
        model_writer=model,
        vocab_size=800,
        user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("user-defined") / "mistral-like.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def edge(user_defined_model: Path) -> Iterator[Edge]:
    served = Edge(models={"ud": user_defined_model})
    yield served
    served.close()


def test_models_says_which_pieces_match_in_text(edge: Edge) -> None:
    described = edge.request("GET", "/v1/models").json()["models"]
    assert [model["user_defined_pieces"] for model in described] == [USER_DEFINED]  # no CONTROL piece
    assert (
        edge.request("GET", "/openapi.json").json()["components"]["schemas"]["ModelDescription"]["properties"][
            "user_defined_pieces"
        ]["type"]
        == "array"
    )


@pytest.mark.parametrize("parse_special_tokens", [False, True])
def test_user_defined_pieces_match_in_text_whatever_parse_special_tokens_says(
    edge: Edge, user_defined_model: Path, parse_special_tokens: bool
) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(user_defined_model))
    expected = sp.encode(TEXTS)  # the library in-process: the reference
    answer = edge.request(
        "POST", "/v1/tokenize", json={"texts": TEXTS, "parse_special_tokens": parse_special_tokens}
    ).json()
    assert answer["ids"] == expected
    ref, control = sp.piece_to_id("[REF]"), sp.piece_to_id("<ctl>")
    assert ref in answer["ids"][0] and ref in answer["ids"][1]  # "[REF]" is its id, as documented
    assert control not in answer["ids"][1]  # "<ctl>" (CONTROL) is text: never its id


def test_other_kinds_have_none_and_old_descriptions_read_back(user_defined_model: Path) -> None:
    info = inspect_model("ud", user_defined_model)
    assert info.user_defined_pieces == tuple(USER_DEFINED)
    described = info.as_dict()
    again = ModelInfo.from_dict({**described, "user_defined_pieces": list(USER_DEFINED)}, user_defined_model)
    assert again.user_defined_pieces == tuple(USER_DEFINED)
    older = {key: value for key, value in described.items() if key != "user_defined_pieces"}  # metadata.json before
    assert ModelInfo.from_dict(older, user_defined_model).user_defined_pieces == ()
    bundled = inspect_model("default", Path(__file__).parents[1] / "app" / "models" / "default.model")
    assert bundled.user_defined_pieces == ()
