import json
import pathlib

import pytest

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "verl_0_9_1.json"


@pytest.fixture(scope="session")
def verl():
    """verl 0.9.1's own outputs, written by scripts/make_verl_fixtures.py (float64, CPU)."""
    with FIXTURE.open() as f:
        return json.load(f)
