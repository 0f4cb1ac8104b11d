"""Shared by the evaluation tests: eval/ on the import path, and the `rng` fixture.

Fresh random inputs each run; the seed is printed (EPS_TEST_SEED=N replays it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "eval"))


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(os.environ.get("EPS_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"EPS_TEST_SEED={seed}")
    return np.random.default_rng(seed)
