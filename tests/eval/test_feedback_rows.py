"""eps_eval.feedback_rows: core ApplyFeedback's rule on a hand example."""

from __future__ import annotations

import numpy as np
from eps_eval.feedback_rows import fed_scores


def test_fed_groups_take_exact_values_and_the_rest_the_heads_median_shift():
    estimate = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    exact = np.array([[5.0, 2.0, 9.0, 0.0], [1.0, 3.0, 0.0, 0.0]])
    visited = np.array([True, True, False, False])
    got = fed_scores(estimate, exact, visited)
    # head 0: diffs 4 and 0, median 2; head 1: diffs 1 and 3, median 2
    np.testing.assert_array_equal(got, [[5.0, 2.0, 5.0, 6.0], [1.0, 3.0, 2.0, 2.0]])


def test_nothing_visited_leaves_the_estimate():
    estimate = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = fed_scores(estimate, np.zeros((2, 3)), np.zeros(3, dtype=bool))
    np.testing.assert_array_equal(got, estimate)
