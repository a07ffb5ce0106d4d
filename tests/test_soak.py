"""A short soak on CPU (the 10,000-step run is tools/gpu_check.sh's): random admissions, appends,
commits, evictions, forks and releases checked against a host-side model of every sequence."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import soak  # noqa: E402

pytestmark = pytest.mark.long  # a soak: `pytest -m long`


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_soak(layout):
    counts = soak.soak_paged(150, check_every=10, seed=1, shape=soak.PagedShape(layout=layout))
    # The run did what a soak is for: every kind of step, and enough pressure to refuse some.
    assert min(counts[a] for a in ("append", "fork", "release", "compact")) > 5, counts
    assert counts["forks_made"] > 0 and counts["tokens_live"] > 0, counts


def test_linear_soak():
    counts = soak.soak_linear(200, check_every=10, seed=2)
    assert min(counts[a] for a in ("append", "admit", "compact")) > 5, counts


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_soak_with_a_host_tier(layout):
    """Swaps out and in among the other steps, pools small enough that both tiers run out: the
    refused swaps and appends leave every row as the model has it."""
    shape = soak.PagedShape(layout=layout, num_pages=16, host_pages=8)
    counts = soak.soak_paged(200, check_every=10, seed=3, shape=shape)
    assert min(counts[a] for a in ("append", "fork", "release", "compact", "swap_out",
                                   "swap_in")) > 5, counts
    assert counts["swapped_out"] > 0 and counts["swapped_in"] > 0, counts
    assert counts["unserved"] > 0, counts
