"""``check_duration``: the one check of every duration kvdefrag is given."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvdefrag.common import InvalidArgument
from kvdefrag.common.durations import MAX_DURATION_S, check_duration


@pytest.mark.parametrize("value", [0.001, 1, 2.5, np.float64(3.0), MAX_DURATION_S])
def test_a_positive_finite_duration_up_to_a_day_is_returned_as_a_float(value: float) -> None:
    seconds = check_duration("timeout_s", value)
    assert seconds == float(value)
    assert type(seconds) is float


@pytest.mark.parametrize(
    "value", [0, -1, math.inf, -math.inf, math.nan, 1e12, MAX_DURATION_S + 1, 10**400, True, "5"]
)
def test_a_bad_duration_is_refused_naming_it_the_value_and_the_range(value: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_duration("step_wait", value)
    assert str(caught.value).startswith("step_wait must be a number of seconds > 0 and <= 86400")
    assert str(caught.value).endswith(f"got {value!r}")


def test_zero_is_accepted_only_where_allowed_and_the_maximum_may_be_lower() -> None:
    assert check_duration("grace_s", 0, allow_zero=True) == 0.0
    with pytest.raises(InvalidArgument, match=r"grace_s must be a number of seconds >= 0"):
        check_duration("grace_s", -0.5, allow_zero=True)
    assert check_duration("handshake", 3600, max_s=3600) == 3600.0
    with pytest.raises(InvalidArgument, match=r"handshake must .* <= 3600, got 3601"):
        check_duration("handshake", 3601, max_s=3600)
