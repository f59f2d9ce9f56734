"""The worker gives back the library pages TensorFlow's import touched, and training still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.bridge import REPO

pytest.importorskip("keras")
pytestmark = pytest.mark.training

CHILD = """
    import json, keras
    import numpy as np
    from worker import memory
    from worker.trainer.model import get_sae  # imports TensorFlow

    def library_pages():
        # kB of the libraries' clean pages this process maps: alone, and with other processes.
        sizes, inside = {"Private_Clean": 0, "Shared_Clean": 0}, False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                first = line.split()[0]
                if "-" in first and not first.endswith(":"):
                    name = line.split()[-1].rsplit("/", 1)[-1]
                    inside = (name.endswith(".so") or ".so." in name) and "w" not in line.split()[1]
                elif inside and first[:-1] in sizes:
                    sizes[first[:-1]] += int(line.split()[1])
        return sizes

    before, rss_before = library_pages(), memory.rss_bytes()
    released = memory.release_library_pages()
    after, rss_after = library_pages(), memory.rss_bytes()
    keras.utils.set_random_seed(0)
    model = get_sae(32, 32)
    x = np.random.default_rng(0).random((4, 32, 32, 3), dtype=np.float32)
    losses = [float(model.train_on_batch(x, (x[..., :1] > 0.5).astype(np.float32))[0]) for _ in range(3)]
    print(json.dumps({"before": before, "after": after, "released": released, "rss_before": rss_before,
                      "rss_after": rss_after, "losses": losses}))
"""


def test_release_library_pages_unmaps_them_and_training_goes_on() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = result["before"], result["after"]
    touched_before = before["Private_Clean"] + before["Shared_Clean"]
    touched_after = after["Private_Clean"] + after["Shared_Clean"]
    # TensorFlow's import leaves some 300-420 MB of its libraries' clean pages mapped; they go
    # (shared ones too: unmapping leaves them to the page cache and to the other processes).
    assert touched_before > 250 * 1024
    assert touched_after <= 0.1 * touched_before + 8 * 1024  # kB
    assert result["released"] > 200 << 20
    assert abs(result["rss_after"] - (result["rss_before"] - result["released"])) < 16 << 20
    assert all(0 < loss < 10 for loss in result["losses"]) and len(set(result["losses"])) == 3  # it trains
