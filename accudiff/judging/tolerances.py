"""Tolerances: documented defaults per precision, a user default, and per-tensor overrides.

Per-tensor options follow polygraphy's mapping-with-default shape: `--atol logits:1e-2 1e-3` sets 1e-3
for every tensor and 1e-2 for `logits`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

from accudiff.errors import AccudiffError


@dataclass(frozen=True)
class Tolerance:
    """An element passes when `|cand - ref| <= atol + rtol * |ref| + stol * absmax(ref tensor)`.

    `stol` exists because rounding error follows the magnitude of an op's operands, not of its result:
    `a - b` of two values near 500 is off by FP16's rounding at 500 (0.25) even where the result is
    near 0, which no fixed atol/rtol pair accepts without also accepting real faults elsewhere.
    """

    atol: float
    rtol: float
    stol: float = 0.0


# Chosen so that a healthy model passes and a broken one fails (README, "Tolerances"):
# fp32: reordered accumulation only; fp16: a few FP16 roundings (2^-11 = 4.9e-4 each) relative to the
# element and to the tensor's scale; bf16: FP16's scaled by 8, BF16's rounding (2^-8) being 8 times FP16's;
# int8: about two quantization steps (1/127) of the tensor's scale; fp8: INT8's, with two E4M3 roundings
# (2^-4 each) relative to the element; int4 and fp4: about two steps of a 4-bit grid (1/7). Activations
# quantized as the model runs (int8-dynamic) sit on the same 255-step grid, its range taken from each
# sample instead of calibration: INT8's. Weights alone on a grid (int8/int4-weight) leave activations
# float, but an output's error still follows the weights' step: the grid's own values; a 2-bit grid (a
# step of a third of a block's range) gets twice INT4's, where only the decision figures say much.
DEFAULT_TOLERANCES = {
    "fp32": Tolerance(atol=1e-5, rtol=1e-4, stol=0.0),
    "fp16": Tolerance(atol=1e-3, rtol=1e-2, stol=2e-3),
    "bf16": Tolerance(atol=8e-3, rtol=8e-2, stol=1.6e-2),
    "int8": Tolerance(atol=1e-2, rtol=1e-1, stol=2e-2),
    "int8-dynamic": Tolerance(atol=1e-2, rtol=1e-1, stol=2e-2),
    "fp8": Tolerance(atol=1e-2, rtol=1.25e-1, stol=2e-2),
    "int4": Tolerance(atol=5e-2, rtol=2.5e-1, stol=1e-1),
    "fp4": Tolerance(atol=5e-2, rtol=2.5e-1, stol=1e-1),
    "int8-weight": Tolerance(atol=1e-2, rtol=1e-1, stol=2e-2),
    "int4-weight": Tolerance(atol=5e-2, rtol=2.5e-1, stol=1e-1),
    "int2-weight": Tolerance(atol=1e-1, rtol=5e-1, stol=2e-1),
}


def default_tolerance(precision: str) -> Tolerance:
    """The default of a precision; a candidate holding several formats ("int8+fp16") gets the loosest of
    theirs, field by field (its error is at least the coarsest format's)."""
    if precision in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[precision]
    parts = [DEFAULT_TOLERANCES[f] for f in precision.split("+")]
    return Tolerance(*(max(getattr(t, name) for t in parts) for name in ("atol", "rtol", "stol")))


@dataclass(frozen=True)
class Tolerances:
    default: Tolerance
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # {"atol": {"logits": 1e-2}, ...}

    def __post_init__(self) -> None:
        # An option none of whose tensors is overridden is left out: `for_tensor` then answers at once.
        object.__setattr__(self, "overrides", {option: named for option, named in self.overrides.items() if named})

    @classmethod
    def build(
        cls,
        precision: str,
        atol: Iterable[str] | float | None = None,
        rtol: Iterable[str] | float | None = None,
        stol: Iterable[str] | float | None = None,
    ) -> "Tolerances":
        base = default_tolerance(precision)
        defaults, overrides = {}, {}
        for option, given in (("atol", atol), ("rtol", rtol), ("stol", stol)):
            default, overrides[option] = parse_named_values(option, given)
            defaults[option] = getattr(base, option) if default is None else default
        return cls(Tolerance(**defaults), overrides)

    def require_known_tensors(self, tensors: set[str]) -> None:
        """A per-tensor tolerance for a tensor the model does not have would silently apply to nothing."""
        for option, overrides in self.overrides.items():
            unknown = [name for name in overrides if name not in tensors]
            if unknown:
                raise AccudiffError(f"--{option} names a tensor '{unknown[0]}' that the model does not compute")

    def for_tensor(self, name: str) -> Tolerance:
        if not self.overrides:  # asked for every tensor of every sample: most runs override none
            return self.default
        return Tolerance(
            **{option: self.overrides.get(option, {}).get(name, getattr(self.default, option)) for option in ("atol", "rtol", "stol")}
        )

    def as_dict(self) -> dict:
        return {**asdict(self.default), "per_tensor": self.overrides}

    @classmethod
    def from_dict(cls, document: dict) -> "Tolerances":
        """The inverse of `as_dict`."""
        return cls(Tolerance(document["atol"], document["rtol"], document["stol"]), dict(document["per_tensor"]))


def parse_named_values(option: str, values: Iterable[str] | float | None) -> tuple[float | None, dict[str, float]]:
    """Split `["1e-3", "logits:1e-2"]` into the default (1e-3) and the overrides ({"logits": 1e-2}): how
    every option that takes a default and per-tensor values reads them."""
    if values is None:
        return None, {}
    if isinstance(values, (int, float)):
        values = [str(values)]
    default, overrides = None, {}
    for item in values:
        name, _, number = str(item).rpartition(":")
        try:
            value = float(number)
        except ValueError:
            raise AccudiffError(f"--{option} '{item}' is not a number or name:number") from None
        if not math.isfinite(value):
            raise AccudiffError(f"--{option} '{item}' is not finite: every element would pass")
        if value < 0:
            raise AccudiffError(f"--{option} value '{item}' is negative")
        if name:
            overrides[name] = value
        else:
            default = value
    return default, overrides
