"""parity.contract.engine.check_tokens: the token check every peer engine shares."""

from __future__ import annotations

import numpy as np
import pytest

from parity.contract.engine import check_tokens
from parity.contract.errors import ParityError


def test_integer_tokens_come_back_as_int64():
    got = check_tokens(np.array([0, 5, 9], np.int32), 10, "embed")
    assert got.dtype == np.int64 and got.tolist() == [0, 5, 9]
    assert check_tokens([3], 10, "embed").tolist() == [3]


@pytest.mark.parametrize("tokens,match", [([], "non-empty 1-D"), ([[1, 2]], "non-empty 1-D"),
                                          ([1.0, 3.7], "must be integers, got dtype float64"),
                                          (["1"], "must be integers"), ([10], r"outside \[0, 10\): 10..10"),
                                          ([-1, 2], r"outside \[0, 10\): -1..2")])
def test_bad_tokens_are_refused_naming_where(tokens, match):
    with pytest.raises(ParityError, match=f"layer 3: .*{match}"):
        check_tokens(tokens, 10, "layer 3")
