"""Shared fixtures: the package is imported from the build tree (PYTHONPATH set by ctest)."""
import numpy as np
import pytest


@pytest.fixture
def rng():
  return np.random.default_rng(1234)
