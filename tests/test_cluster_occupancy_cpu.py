"""The probe that counts resident clusters (kernels/cluster_occupancy.py), without a GPU."""

import pytest

from tileops.kernels import cluster_occupancy
from tileops.kernels.cluster_occupancy import SM_SHARED_BYTES, probe_shared_bytes


@pytest.mark.parametrize("ctas_per_sm", [1, 2, 3, 4])
def test_probe_shared_memory_holds_exactly_that_many_ctas(ctas_per_sm):
    """k probe CTAs fit an SM's shared memory (each reserving 1 KB more), k + 1 do not."""
    per_cta = probe_shared_bytes(ctas_per_sm) + 1024
    assert ctas_per_sm * per_cta <= SM_SHARED_BYTES < (ctas_per_sm + 1) * per_cta


def test_counts_are_asked_once_per_device_and_shape(monkeypatch):
    """A known (device, shape) is answered from the table, not the driver."""
    monkeypatch.setattr(cluster_occupancy, "_counts", {("cuda:7", 4, 256, 2): 61})
    monkeypatch.setattr(cluster_occupancy, "_probe", lambda index: pytest.fail("asked"))
    assert cluster_occupancy.resident_clusters("cuda:7", 4, 256, 2) == 61
