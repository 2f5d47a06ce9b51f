"""pytest plugin shipped with plait: fixtures for plugin authors' tests."""

import pytest

from plait.manager import make_plugins


@pytest.fixture
def plait_plugins():
    """A fresh plait plugin manager with every installed plugin loaded."""
    return make_plugins()
