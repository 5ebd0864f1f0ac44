"""How numbers read in what accudiff says (console, report, findings, pytest messages)."""

from __future__ import annotations

import math
from typing import Callable


def percent(share: float, decimals: int = 1) -> str:
    """`share` (0 to 1) as a percentage that never claims more than was measured: a share that is neither
    0 nor 1 never reads as 0% or 100% after rounding (1 element of 265,000 is '<0.1%', not '0.0%'; 439
    tensors of 440 are '>99%', not '100%')."""
    if not math.isfinite(share):
        return f"{share}%"
    step = 10.0**-decimals
    shown = round(share * 100, decimals)
    if 0 < share and shown == 0:
        return f"<{step:.{decimals}f}%"
    if share < 1 and shown >= 100:
        return f">{100 - step:.{decimals}f}%"
    return f"{share * 100:.{decimals}f}%"


def times_tolerance(ratio: float, suffix: str = " its tolerance") -> str:
    """An error as a multiple of its tolerance or requirement ('3.2x its tolerance'), read on the side of 1
    it lies on: a KL of 0.00804 against 0.008 is '1.005x', not '1x', which would read as met; '>1x' where
    nine digits cannot tell it from 1. The ratio is infinite only where the candidate has NaN or Inf and the
    reference does not: said in words, not as 'infx'."""
    if not math.isfinite(ratio):
        return "NaN/Inf (beyond any tolerance)"
    digits = 3
    while ratio != 1 and float(f"{ratio:.{digits}g}") == 1:
        if digits == 9:
            return f"{'>' if ratio > 1 else '<'}1x{suffix}"
        digits += 1
    return f"{ratio:.{digits}g}x{suffix}"


def digits_apart(value: float, target: float | None, style: Callable[[float, int], str], digits: int) -> int:
    """The digits `style` needs for `value` not to read as `target` when it is not: a KL of 0.008024 beside a
    target of 0.008 reads '0.008024', not '0.008', which reads as on the target (at most nine more); `digits`
    where there is no target."""
    most = digits + 9
    while target is not None and value != target and digits < most and style(value, digits) == style(target, digits):
        digits += 1
    return digits


def general(value: float, digits: int) -> str:
    """A number to `digits` significant digits; an infinity as "Inf"."""
    return ("Inf" if value > 0 else "-Inf") if math.isinf(value) else f"{value:.{digits}g}"


def signed(value: float, digits: int) -> str:
    """A change, its sign always shown ("+0.0004", "-0.0032")."""
    return f"{value:+.{digits}g}"


def fixed(value: float, digits: int) -> str:
    """A number to `digits` decimals (a cosine: 0.999963)."""
    return f"{value:.{digits}f}"
