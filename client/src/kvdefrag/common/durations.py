"""One check for every duration a caller or an operator gives kvdefrag, in seconds.

A duration ends up in ``time.monotonic() + duration``, a lock's or an event's
``timeout`` and a gRPC deadline; each of those overflows or misbehaves somewhere past a
few centuries, and NaN compares false with everything. So a duration is checked where it
enters (an argument, a flag, an environment variable) and refused there, by name, before
anything changes::

    finite, a real number (not a bool)
    > 0, or >= 0 where no wait at all means something
    <= a maximum: ``MAX_DURATION_S`` (one day) unless the setting documents less
"""

from __future__ import annotations

import math
import numbers

from kvdefrag.common.errors import InvalidArgument

MAX_DURATION_S = 86_400.0
"""The longest duration any kvdefrag setting accepts: one day."""


def check_duration(
    name: str, value: object, *, allow_zero: bool = False, max_s: float = MAX_DURATION_S
) -> float:
    """Returns ``value`` as a float of seconds, once it is a valid duration.

    Args:
        name: What the caller calls it (an argument, a flag, an environment variable),
            for the message.
        value: The duration given.
        allow_zero: Accept 0 (no wait at all); otherwise it must be positive.
        max_s: The largest accepted value.

    Raises:
        InvalidArgument: ``value`` is not a number, not finite, below the minimum or above
            ``max_s``; the message names ``name``, the value and the range.
    """
    lower = ">= 0" if allow_zero else "> 0"
    expected = f"{name} must be a number of seconds {lower} and <= {max_s:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{expected}, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    is_above_minimum = seconds >= 0 if allow_zero else seconds > 0
    if not (math.isfinite(seconds) and is_above_minimum and seconds <= max_s):
        raise InvalidArgument(f"{expected}, got {value!r}")
    return seconds
