"""Request bodies, validated by pydantic (in Rust) from what orjson parsed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SampleOptions(_Body):
    """SentencePiece subword regularization; the same seed gives the same ids."""

    alpha: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1)] = 0.1
    nbest_size: Annotated[StrictInt, Field(ge=-1)] = -1
    seed: Annotated[StrictInt, Field(ge=0, lt=1 << 32)] | None = None


class TokenizeRequest(_Body):
    texts: list[StrictStr]
    model: StrictStr | None = None
    add_bos: StrictBool = False
    add_eos: StrictBool = False
    max_length: Annotated[StrictInt, Field(ge=0)] | None = None
    sample: SampleOptions | None = None


class DetokenizeRequest(_Body):
    ids: list[list[StrictInt]]
    model: StrictStr | None = None


def openapi_body(model: type[BaseModel]) -> dict[str, object]:
    """`openapi_extra` for a route that parses its own body, so the schema still documents it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "x-components": definitions,
    }


class PackRequest(_Body):
    texts: list[StrictStr]
    seq_len: StrictInt
    strategy: Literal["concat", "best_fit"] = "concat"
    model: StrictStr | None = None
    add_bos: StrictBool = False
    add_eos: StrictBool = True
    carry: list[StrictInt] | None = None
    mask_document_start: StrictBool = False
