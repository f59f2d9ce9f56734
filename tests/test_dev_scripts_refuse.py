"""The dev-cluster scripts build a disposable cluster, and leave a real one alone.

``deploy/dev/slurm.sh up`` and ``deploy/dev/gridengine.sh up`` refuse to touch a scheduler
configuration they did not write. The scripts are pointed at a scratch folder holding a
"site" configuration; they must exit non-zero, say why, and leave every file as it was.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the dev-cluster scripts run as root only")


def _up(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "deploy" / "dev" / script), "up"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_slurm_script_refuses_a_slurm_conf_it_did_not_write(tmp_path: Path) -> None:
    etc = tmp_path / "etc-slurm"
    etc.mkdir()
    (etc / "slurm.conf").write_text("ClusterName=production\nSlurmctldHost=head01\n")
    (etc / "cgroup.conf").write_text("ConstrainRAMSpace=yes\n")
    before = _tree(etc)
    result = _up("slurm.sh", {"HPC_DEV_SLURM_ETC": str(etc)})
    assert result.returncode != 0
    assert f"refusing to touch {etc}/slurm.conf" in result.stderr
    assert _tree(etc) == before


def test_slurm_script_recognises_its_own_configuration() -> None:
    """The live dev cluster's slurm.conf carries the marker the refusal looks for."""
    first = Path("/etc/slurm/slurm.conf").read_text().splitlines()[0]
    script = (REPO / "deploy" / "dev" / "slurm.sh").read_text()
    assert f'readonly MARKER="{first}"' in script


def test_grid_engine_script_refuses_a_cell_it_did_not_create(tmp_path: Path) -> None:
    common = tmp_path / "sge" / "default" / "common"
    common.mkdir(parents=True)
    (common / "bootstrap").write_text("admin_user sgeadmin\nspooling_method classic\n")
    (common / "act_qmaster").write_text("head01\n")
    before = _tree(tmp_path)
    result = _up("gridengine.sh", {"HPC_DEV_SGE_ROOT": str(tmp_path / "sge")})
    assert result.returncode != 0
    assert f"refusing to touch the Grid Engine cell {tmp_path}/sge/default" in result.stderr
    assert _tree(tmp_path) == before
