"""Request arrival schedules: Poisson by default, gamma-distributed gaps with burstiness."""

import math

import numpy as np
import pytest

from bench.serve import arrival_times, normalize_url, tenant_keys


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_schedule_is_seeded_and_increasing():
    a = arrival_times(100, 4.0, 1.0, seed=1)
    assert a == arrival_times(100, 4.0, 1.0, seed=1)
    assert a != arrival_times(100, 4.0, 1.0, seed=2)
    assert a[0] == 0.0
    assert all(later >= earlier for earlier, later in zip(a, a[1:], strict=False))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gap_statistics(burstiness):
    # gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k)
    gaps = np.diff(arrival_times(40001, 10.0, burstiness, seed=0))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


@pytest.mark.parametrize(("rate", "burstiness"), [(0, 1.0), (-1, 1.0), (1.0, 0), (1.0, -2)])
def test_bad_schedule(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_times(3, rate, burstiness, seed=0)


def test_tenant_keys():
    assert tenant_keys(["a", "b", "c"], 2) == ["a", "b"]
    assert tenant_keys([], 1) == [None]
    with pytest.raises(ValueError, match="needs 3 API keys"):
        tenant_keys(["a"], 3)
    with pytest.raises(ValueError, match="needs 2 API keys"):
        tenant_keys([], 2)
    with pytest.raises(ValueError):
        tenant_keys(["a"], 0)


def test_normalize_url():
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    assert normalize_url("http://h:1") == "http://h:1"
