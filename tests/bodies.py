"""What a client sent, read back by the tests' fake servers: a JSON body, or texts as a binary frame
(docs/api.md, "Binary request bodies"), with the client's own wire module only."""

from __future__ import annotations

import itertools
import json
from typing import Any

from tokenizer_client import wire


def sent_body(content: bytes) -> dict[str, Any]:
    """The request body `content` stands for, as the JSON document it replaces."""
    if not content.startswith(wire.MAGIC):
        return json.loads(content)
    frame = wire.decode(content)
    data, bounds = frame["texts"].tobytes(), frame["offsets"].tolist()
    return {**frame.meta, "texts": [data[start:end].decode() for start, end in itertools.pairwise(bounds)]}
