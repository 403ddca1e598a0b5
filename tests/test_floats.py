"""The tolerance helper itself: bounds scale with the magnitude compared, and can fail."""

from __future__ import annotations

import numpy as np
import pytest

from tests.floats import EPS32, assert_close, excess


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_the_bound_is_epsilons_of_the_largest_magnitude(magnitude):
    want = np.array([magnitude, -magnitude / 2, 0.0])
    step = 64 * EPS32 * magnitude
    assert_close(want + [0.0, step * 0.99, 0.0], want, 64)
    with pytest.raises(AssertionError, match="float32 epsilons"):
        assert_close(want + [0.0, step * 1.01, 0.0], want, 64)
    assert excess(want + [0.0, 0.0, 2 * step], want, 64) == pytest.approx(2.0)


def test_shapes_and_zeros():
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.zeros(3), np.zeros(4), 16)
    assert_close(np.zeros(3), np.zeros(3), 16)  # nothing to scale by, nothing differs
    assert excess(np.array([1e-30]), np.zeros(1), 16) == float("inf")
