"""tests/support/cluster.py: one helper per scheduler backend, and none for a backend it does not know.

Each helper runs its own scheduler's commands (queue, accounting, cancel); there is no "else" that
would run Grid Engine's qstat/qdel on a third backend. No scheduler is needed: nothing here runs one.
"""

from __future__ import annotations

import pytest

from bridge.schedulers import BACKENDS
from tests.support.cluster import CLUSTERS, Cluster, GridEngineCluster, SlurmCluster


def test_each_backend_has_its_own_helper() -> None:
    assert set(CLUSTERS) == set(BACKENDS), "add a Cluster subclass for the new backend to tests/support/cluster.py"
    assert type(Cluster("slurm")) is SlurmCluster and type(Cluster("gridengine")) is GridEngineCluster
    for name, helper in CLUSTERS.items():
        cluster = Cluster(name)
        assert isinstance(cluster, helper) and cluster.name == name == cluster.backend.name
        assert cluster.submit_command == BACKENDS[name].commands[0]
    assert Cluster("slurm") == SlurmCluster("slurm") != Cluster("gridengine")
    assert len({Cluster("slurm"), Cluster("slurm"), Cluster("gridengine")}) == 2


@pytest.mark.parametrize("name", ["pbs", "", "Slurm", "sge"])
def test_an_unknown_backend_raises(name: str) -> None:
    with pytest.raises(ValueError, match="no test cluster helper for the scheduler backend") as caught:
        Cluster(name)
    assert "CLUSTERS" in str(caught.value) and "gridengine, slurm" in str(caught.value)


def test_a_helper_is_only_its_own_backend() -> None:
    with pytest.raises(ValueError, match="helper for 'slurm', not for 'gridengine'"):
        SlurmCluster("gridengine")


def test_a_helper_must_have_every_command() -> None:
    """A new backend's helper that leaves out one of the commands cannot be made (no silent fallback)."""

    class Incomplete(Cluster):
        name = "incomplete"

        def jobs_named(self, name: str) -> list[str]:
            return []

    CLUSTERS["incomplete"] = Incomplete
    try:
        with pytest.raises(TypeError, match="abstract"):
            Cluster("incomplete")
    finally:
        del CLUSTERS["incomplete"]
