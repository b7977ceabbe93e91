"""Shared pytest fixtures. Keep this small: fixtures used by more than one test file only."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, fixed-seed generator for each test, so every test is deterministic on its own."""
    return np.random.default_rng(1234)
