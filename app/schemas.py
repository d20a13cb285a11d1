"""Request bodies, validated by pydantic (in Rust) from what orjson parsed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, WithJsonSchema

MAX_NBEST_SIZE = 512
"""sentencepiece's kMaxNBestSize; it raises on 0, 1 or more."""

INT32_MAX = (1 << 31) - 1
"""One bound for every integer field that is a length, a position or an id: ids and lengths travel as int32."""

Id = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # a token id (the model's vocabulary is checked later)
Count = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # a length or a position


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_nbest_size(value: int) -> int:
    if value == -1 or 2 <= value <= MAX_NBEST_SIZE:
        return value
    raise ValueError(f"must be -1 (sample from every segmentation) or between 2 and {MAX_NBEST_SIZE}, got {value}")


NBestSize = Annotated[
    StrictInt,
    AfterValidator(_check_nbest_size),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "const": -1}, {"type": "integer", "minimum": 2, "maximum": MAX_NBEST_SIZE}]}
    ),
]


class SampleOptions(_Body):
    """SentencePiece subword regularization; the same seed gives the same ids."""

    alpha: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.1  # strict float still takes a JSON 1
    nbest_size: NBestSize = -1
    seed: Annotated[StrictInt, Field(ge=0, lt=1 << 32)] | None = None


class EncodeOptions(_Body):
    """How texts become ids: the options of /v1/tokenize, declared once, and what a worker encodes with."""

    add_bos: StrictBool = False
    add_eos: StrictBool = False
    max_length: Count | None = None
    sample: SampleOptions | None = None
    parse_special_tokens: StrictBool = False  # special-token strings in the text become their ids

    @property
    def seed(self) -> int | None:
        return None if self.sample is None else self.sample.seed

    def without_texts(self) -> EncodeOptions:
        """The options alone (what each chunk of a split request carries): these are."""
        return self


class _TextsAndModel(_Body):
    texts: list[StrictStr]
    model: StrictStr | None = None


class TokenizeRequest(EncodeOptions, _TextsAndModel):  # texts and model first, as before EncodeOptions
    def without_texts(self) -> EncodeOptions:
        """The options alone, without the texts (what each chunk of a split request carries)."""
        return EncodeOptions.model_construct(**{name: getattr(self, name) for name in EncodeOptions.model_fields})


class DetokenizeRequest(_Body):
    ids: list[list[Id]]
    model: StrictStr | None = None


def openapi_body(model: type[BaseModel]) -> dict[str, object]:
    """`openapi_extra` for a route that parses its own body, so the schema still documents it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "x-components": definitions,
    }


# What JSON Schema can say of /v1/pack beyond each field: the carry and its document starts belong to
# concat, and the starts need the carry they describe (the server refuses the rest with a 422).
PACK_CONSTRAINTS: dict[str, object] = {
    "dependentRequired": {"carry_document_starts": ["carry"]},
    "if": {"properties": {"strategy": {"const": "best_fit"}}, "required": ["strategy"]},
    "then": {"properties": {"carry": {"type": "null"}, "carry_document_starts": {"type": "null"}}},
}


class PackRequest(_Body):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=PACK_CONSTRAINTS)

    texts: list[StrictStr]
    seq_len: Annotated[StrictInt, Field(ge=2, le=INT32_MAX)]  # and at most --max-seq-len (in the published schema)
    strategy: Literal["concat", "best_fit"] = "concat"
    model: StrictStr | None = None
    add_bos: StrictBool = False
    add_eos: StrictBool | None = None  # EOS after each document when the model has one
    carry: list[Id] | None = None
    carry_document_starts: list[Count] | None = None
    mask_document_start: StrictBool = False
    parse_special_tokens: StrictBool = False
