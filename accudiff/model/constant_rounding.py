"""What storing a float constant in a narrower float format does to it, in words that name the mechanism.

Exporters write masks with FP32's extremes (-3.4028e38, `finfo(float32).min`) and epsilons far below FP16's
smallest subnormal (1e-12). Stored as they are, the first become -Inf, and a product with -Inf is NaN
wherever the other factor is 0; the second become 0, and no longer keep a denominator away from 0. Both are
findings of the node that reads the constant ("constant_overflow", "constant_underflow"), whatever the
format, and the first is why autokeep leaves a node in FP32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP32_LOWEST, FP32_LARGEST = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)
PRODUCT_OPS = frozenset({"Mul", "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul", "BatchNormalization"})
# A sum read by one of these is a denominator (or under a root): an epsilon in it keeps it away from 0.
DENOMINATOR_OPS = {"Sqrt": 0, "Reciprocal": 0, "Div": 1, "Log": 0, "Pow": 0}
UNDERFLOW_SHARE = 0.01  # of a large constant's nonzero values lost to 0: below this, a few tiny weights


@dataclass
class ConstantRounding:
    """Counts over one constant, merged a block at a time (a weight may take gigabytes)."""

    absmax: float = 0.0  # of its finite values
    size: int = 0
    to_inf: int = 0  # finite values the format holds as +-Inf
    inf_value: float = 0.0  # the largest of them in magnitude, signed
    nonzero: int = 0
    to_zero: int = 0  # nonzero values the format holds as 0
    zero_value: float = 0.0  # the largest of them in magnitude, signed

    def add(self, values: np.ndarray, stored: np.ndarray) -> None:
        """Count a block of FP32 `values` and the same values as the format holds them (as FP32)."""
        values, stored = values.reshape(-1), stored.reshape(-1)
        finite = np.isfinite(values)
        self.size += values.size
        if finite.any():
            self.absmax = max(self.absmax, float(np.abs(values[finite]).max()))
        overflowed = finite & np.isinf(stored)
        if overflowed.any():
            self.to_inf += int(overflowed.sum())
            self.inf_value = _largest(self.inf_value, values[overflowed])
        nonzero = finite & (values != 0)
        self.nonzero += int(nonzero.sum())
        flushed = nonzero & (stored == 0)
        if flushed.any():
            self.to_zero += int(flushed.sum())
            self.zero_value = _largest(self.zero_value, values[flushed])

    @property
    def underflow_matters(self) -> bool:
        """Nonzero values became 0 in a small constant (an epsilon, a scale), or in a share of a large one
        that is more than a few tiny weights."""
        return self.to_zero > 0 and (self.size <= 64 or self.to_zero >= UNDERFLOW_SHARE * self.nonzero)


def overflow_text(name: str, rounding: ConstantRounding, op_type: str, label: str, largest: float, happened: bool) -> str:
    """Why the node reading constant `name` gets Inf (`happened`), or would if it computed in the format."""
    value = rounding.inf_value
    known = " (FP32's lowest, which exporters write where a mask hides a position)" if value == FP32_LOWEST else " (FP32's largest)" if value == FP32_LARGEST else ""
    sign = "-" if value < 0 else "+"
    if rounding.to_inf == 1 or rounding.size == 1:
        held = f"its constant '{name}' holds {value:.5g}{known}"
        became = f"{'it became' if happened else 'it would be'} {sign}Inf"
    else:
        held = f"{rounding.to_inf} values of its constant '{name}' (up to {value:.5g}{known})"
        became = f"{'they became' if happened else 'they would be'} Inf"
    text = f"{held}, beyond {label}'s largest finite value {largest:.5g}: in {label} {became}"
    if op_type in PRODUCT_OPS:
        text += f"; 0 × Inf is NaN, so the {op_type} {'gives' if happened else 'would give'} NaN wherever it multiplies that by 0"
    return text


def underflow_text(name: str, rounding: ConstantRounding, label: str, smallest: float, denominator: str | None = None) -> str:
    """Why values of constant `name` are 0 in the format; `denominator`, a node that reads the sum it is
    added to as a denominator (the constant is an epsilon)."""
    value = rounding.zero_value
    if rounding.nonzero == 1:
        text = f"its constant '{name}' holds {value:.3g}, below half {label}'s smallest subnormal {smallest:.3g}: in {label} it became 0"
    else:
        text = (f"{rounding.to_zero} of the {rounding.nonzero} nonzero values of its constant '{name}' (up to {abs(value):.3g}) are below half "
                f"{label}'s smallest subnormal {smallest:.3g}: in {label} they became 0")
    if denominator is not None:
        text += f", so it no longer keeps the {denominator} that reads the sum away from 0"
    return text


def denominator_reader(output: str, readers: list) -> str | None:
    """'Sqrt 'x'' for the first node reading `output` as a denominator (or under a root), else None."""
    for reader in readers:
        position = DENOMINATOR_OPS.get(reader.op_type)
        if position is not None and len(reader.input) > position and reader.input[position] == output:
            return f"{reader.op_type} '{reader.name}'"
    return None


def _largest(current: float, values: np.ndarray) -> float:
    candidate = float(values[np.argmax(np.abs(values))])
    return candidate if abs(candidate) > abs(current) else current
