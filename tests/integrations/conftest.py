"""Shared fixtures of the FastDeploy integration tests."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture
def channel() -> str:
    """A results-channel name no other test (or test run) uses."""
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
