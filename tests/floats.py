"""Float comparisons with tolerances in units of float32 rounding at the compared magnitude.

Two float32 computations of one quantity along different paths (K positions in one
forward against K one-position forwards; another OpenBLAS kernel, core type or
thread count; the BLAS shim's AVX2 or AVX-512 dots) differ only in the order of
their additions. A reordered sum of n terms moves by about sqrt(n) roundings of the
size of its largest terms, and a network carries those errors from layer to layer.
So a bound is counted in float32 epsilons (2^-23, about 1.19e-7) of the largest
magnitude in the array compared: an absolute 1e-5 is tighter than rounding for
values near 100 and looser than a real bug for values near 1e-3.

    assert_close(got, want, ulps=1024, what="logits")

passes while max|got - want| <= ulps * EPS32 * max|want|. `excess` returns that
difference as a multiple of the bound (<= 1: close enough), for negative controls
that must exceed it. Every assert_close is recorded; `pytest --float-report` prints,
per test, the largest difference seen against its bound (the headroom that
`make test-kernels` checks under every kernel choice).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


@dataclass
class Seen:
    ulps: float  # the bound, in EPS32 of the magnitude
    seen_ulps: float  # the largest difference seen (a control: the smallest), same units
    control: bool  # a negative control, which must fall outside its bound


# test name ("test_file.py::test_function") -> label -> the comparison's extreme
RECORD: dict[str, dict[str, Seen]] = {}


def excess(got, want, ulps: float, what: str = "") -> float:
    """max|got - want| as a multiple of `ulps` float32 epsilons of max|want|; a negative
    control names itself in `what` to show in the report how far outside it falls."""
    ratio = _ratio(got, want, ulps, what)
    if what:
        record(what, ulps, ratio, control=True)
    return ratio


def assert_close(got, want, ulps: float, what: str = "", where: str = "") -> None:
    """`what` names the comparison in the report; `where` only adds to a failure's message."""
    ratio = _ratio(got, want, ulps, what)
    record(what, ulps, ratio, control=False)
    assert ratio <= 1.0, (f"{what or 'values'}{' ' + where if where else ''} differ by {ratio * ulps:.3g} "
                          f"float32 epsilons of their magnitude; the bound is {ulps}")


def record(what: str, ulps: float, ratio: float, control: bool) -> None:
    """Keeps a comparison's largest difference and a control's smallest, per test."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("[")[0]
    label = what or "values"
    seen = RECORD.setdefault(test, {}).get(label)
    worse = (lambda new, old: new < old) if control else (lambda new, old: new > old)
    if seen is None or worse(ratio * ulps, seen.seen_ulps):
        RECORD[test][label] = Seen(ulps, ratio * ulps, control)


def _ratio(got, want, ulps: float, what: str) -> float:
    a, b = np.asarray(np.array(got), dtype=np.float64), np.asarray(np.array(want), dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if a.size == 0:
        return 0.0
    diff = float(np.abs(a - b).max())
    bound = ulps * EPS32 * float(np.abs(b).max())
    return diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))


# -- the bounds, by kind of comparison -------------------------------------------------
# Each is 10-20 times the largest difference `make test-kernels` saw under any kernel
# choice (in brackets), and far below what a real bug gives: the negative controls (a
# cache that kept a rejected draft, another token at one position, attention without
# its mask) fall 10^5-10^7 epsilons away.

# One tiny network's outputs (logits, hidden states, KV, recurrent state) computed along
# two paths: K positions in one forward against one at a time, a rewound cache against
# a fresh one, prefill chunks against single steps, a quantized kernel against unpacked
# weights. Each layer's sums (a few hundred terms) are reordered and later layers carry
# the difference. [28]
PATHS_ULPS = 512

# The same after a whole generation (~50-130 positions): recurrent states (GatedDeltaNet)
# and every later position's attention carry each earlier position's rounding forward. [74]
LONG_PATHS_ULPS = 1024

# Long float32 sums against float64 or another kernel (matmuls and attention with up to
# ~2,000-term dot products, softmax and renormalisation over 600-4,096 probabilities):
# about sqrt(terms) roundings of the largest partial sums. [88]
DOT_ULPS = 1024

# A handful of float32 operations on the same inputs along two formulas (silu against
# power-based swiglu, a rotary table against the rope kernel, filtered probabilities
# against float64): each rounds once at a magnitude no larger than the largest compared. [1]
FEW_OPS_ULPS = 16
