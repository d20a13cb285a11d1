"""One comparison of /v1/pack answers with tokenizer_client.packing's rows, for the tests of either."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenizer_client.packing import PackedRows


def assert_same_rows(batch: Any, expected: PackedRows) -> None:
    """`batch` (a PackedBatch, either format) holds `expected`'s rows, leftover and stats."""
    np.testing.assert_array_equal(batch.input_ids, expected.input_ids)
    np.testing.assert_array_equal(batch.labels, expected.labels)
    np.testing.assert_array_equal(batch.position_ids, expected.position_ids)
    np.testing.assert_array_equal(batch.leftover, expected.leftover)
    assert [row.tolist() for row in batch.cu_seqlens] == [
        expected.row_cu_seqlens(r).tolist() for r in range(expected.num_rows)
    ]
    assert batch.stats == expected.stats.as_dict()
