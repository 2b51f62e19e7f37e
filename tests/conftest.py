"""Shared fixtures: where the COS 418 conformance traces live."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT.parent / "shared" / "conformance" / "cos418"
DELAY_TAPE = CONFORMANCE / "go-rand-intn5-seed8053172852482175524.txt"


@pytest.fixture
def cos418() -> Path:
    """The conformance folder; tests that need it skip with a message where it is absent."""
    if not DELAY_TAPE.is_file():
        pytest.skip(f"COS 418 conformance traces not found at {CONFORMANCE}")
    return CONFORMANCE
