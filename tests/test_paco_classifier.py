"""Our models classify a page through Paco_classifier's own ``process_image_msae``, as Rodan 3.x does.

Rodan 3.x's classifier job reads the page with ``cv2.imread`` and calls Paco_classifier's
``recognition_engine.process_image_msae(image, model_paths, height, width, mode="logical")`` with
``Background Model``, ``Model 1`` ... in port order. That function runs here unchanged, from
Paco_classifier's own source (consumers/paco.py), in both TensorFlow environments Rodan runs
(consumers/), on models the worker's trainer wrote. A consumer that is not built fails the test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("keras")  # the worker extra is not installed on login nodes

from bridge.testing.samples import make_sample_page
from consumers import by_name, classify

RODAN_CONSUMERS = ("tf2.5.1-py3.7", "tf2.15.1-py3.11")

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]


@pytest.mark.training
def test_trained_models_classify_a_page_with_pacos_own_classifier(tmp_path: Path) -> None:
    from worker.trainer import load_page, train_page
    from worker.trainer.settings import TrainSettings

    uploads = tmp_path / "uploads"
    inputs = make_sample_page(uploads, generation="new", n_layers=2, height=192, width=224, seed=5)

    def path(name: str) -> Path:
        return uploads / inputs[name].removeprefix("/uploads/")

    layers = {
        "Background": path("Background"),
        "Layer 1": path("rgba PNG - Layer 0"),
        "Layer 2": path("rgba PNG - Layer 1"),
    }
    page = load_page(path("Image"), layers, path("Selected Regions"))
    settings = TrainSettings(
        epochs=2, max_samples_per_label=300, patch_height=32, patch_width=32, batch_size=16, patience=5, seed=3
    )
    models = train_page(page, settings, tmp_path / "models")
    ordered = [models["Background"], models["Layer 1"], models["Layer 2"]]  # Rodan's port order

    results = {}
    for name in RODAN_CONSUMERS:
        out = tmp_path / f"{name}.npy"
        # The classifier job's window, not the training patch: Paco's padding of 25 needs more than 51
        # pixels, and Paco calls predict once per window and model (a larger window: fewer calls).
        info = classify(by_name(name), path("Image"), ordered, (128, 128), out)
        labels = np.load(out)
        assert labels.shape == (page.height, page.width), info
        assert labels.dtype == np.uint8
        assert set(np.unique(labels)) <= {0, 1, 2}, np.unique(labels)
        results[name] = (info, labels)
    (old_info, old), (new_info, new) = results["tf2.5.1-py3.7"], results["tf2.15.1-py3.11"]
    assert old_info["tensorflow"] == "2.5.1" and new_info["tensorflow"] == "2.15.1"
    # The same weights give the same page in both of Rodan's TensorFlow versions.
    assert float(np.mean(old == new)) >= 0.99
