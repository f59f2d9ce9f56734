"""How much of a layer's training targets is the layer: ours (patches centred on a layer pixel) against
Paco_classifier's ``train_msae`` (a layer pixel at the patch's top-left corner), on bench_paco.py's pages.

Each layer's model learns from patches cut where that layer is, so its targets hold more of the layer
than the page does; how much more depends on where the chosen pixel sits in the patch. A model that
trained on a higher layer share predicts the layer on more pixels of a page whose share is lower
(bench_paco.py's "predicted layer share"). This measures that share, with no TensorFlow:

* **page**: the layer's pixels in the selected region (the top ``TRAIN_ROWS`` rows of both pages);
* **ours**: the centres ``worker.trainer.sampling.run_pages_centres`` draws (the worker's sampler),
  each patch's top-left at ``(row - ph // 2, col - pw // 2)``, target = the layer's mask there
  (ANDed with the region, as the worker does);
* **paco**: Paco_classifier's own ``data_loader.extractRandomSamplesClass`` (from
  ``consumers.paco.paco_source()``), called as its generator calls it, one batch at a time, on the
  region-cropped page: a layer pixel drawn uniformly from ``gt[:-ph, :-pw]`` is the patch's
  top-left corner.

    .venv/bin/python benchmarks/bench_patch_share.py              # patches 32 and 256, 1000 samples per label
    .venv/bin/python benchmarks/bench_patch_share.py --quick      # smoke test: patch 32, 64 samples
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench_paco import CROP_PAIRS, LAYER_NAMES, TRAIN_ROWS  # noqa: E402
from tables import print_table  # noqa: E402


def region_masks(work: Path) -> list[list[Any]]:
    """Every page's layer masks (Background, Neumes, StaffLines) inside the selected region."""
    import numpy as np
    from PIL import Image

    from bridge.testing.samples import EINSIEDELN_DIR, synthesize_page_from_masks

    data_dir = Path(os.environ.get("HPC_EINSIEDELN_DIR", str(EINSIEDELN_DIR)))
    pages = []
    for index, crop in enumerate(CROP_PAIRS["32r"]):
        uploads = work / f"uploads-{index}"
        inputs = synthesize_page_from_masks(data_dir, uploads, crop, generation="new", seed=index)
        masks = []
        for name in ("Background", "rgba PNG - Layer 0", "rgba PNG - Layer 1"):
            with Image.open(uploads / inputs[name].removeprefix("/uploads/")) as image:
                mask = np.asarray(image.convert("RGBA").getchannel("A")) == 255
            mask = mask.copy()
            mask[TRAIN_ROWS:] = False  # the selected region: the top rows
            masks.append(mask)
        pages.append(masks)
    return pages


def ours(pages: list[list[Any]], patch: int, samples: int, seed: int) -> list[float]:
    """Mean layer share of the targets of the worker's patches, per layer."""
    import numpy as np

    from worker.trainer.sampling import run_pages_centres

    labels = [str(n) for n in range(len(LAYER_NAMES))]
    centres = run_pages_centres([dict(zip(labels, masks, strict=True)) for masks in pages], patch, patch, samples, seed)
    shares = []
    for label in labels:
        values = []
        for page, row, col in centres[label]:
            top, left = row - patch // 2, col - patch // 2
            values.append(float(pages[page][int(label)][top : top + patch, left : left + patch].mean()))
        shares.append(float(np.mean(values)) if values else float("nan"))
    return shares


def paco_data_loader() -> Any:
    """Paco_classifier's own ``data_loader`` module (``consumers.paco.paco_source()``): standard
    library and NumPy only, so it imports here; the package's ``__init__`` (OpenCV, TensorFlow) is
    not run, as paco_side.py does for the trainer's module."""
    from consumers.paco import paco_source

    package = types.ModuleType("Paco_classifier")
    package.__path__ = [str(paco_source() / "Paco_classifier")]
    sys.modules.setdefault("Paco_classifier", package)
    return importlib.import_module("Paco_classifier.data_loader")


def paco(pages: list[list[Any]], patch: int, samples: int, seed: int, batch: int = 16) -> list[float]:
    """Mean layer share of the targets Paco's own ``extractRandomSamplesClass`` cuts (one batch
    per call, as its generator calls it), per layer, the samples shared by the pages alike."""
    import numpy as np

    data_loader = paco_data_loader()
    np.random.seed(seed)  # Paco draws from NumPy's global generator
    shares = []
    for layer in range(len(LAYER_NAMES)):
        values: list[float] = []
        for masks in pages:
            gt = masks[layer][:TRAIN_ROWS].astype(np.float64)  # Paco crops the page to the region's bounding box
            gr = np.zeros((*gt.shape, 3), dtype=np.uint8)  # the image: only the targets are measured
            for start in range(0, samples // len(pages), batch):
                n = min(batch, samples // len(pages) - start)
                gr_chunks, gt_chunks = np.zeros((n, patch, patch, 3)), np.zeros((n, patch, patch))
                data_loader.extractRandomSamplesClass(gr, gt, patch, patch, n, gr_chunks, gt_chunks)
                values += gt_chunks.reshape(n, -1).mean(axis=1).tolist()
        shares.append(float(np.mean(values)) if values else float("nan"))
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--patches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--samples", type=int, default=1000, help="samples per label (Rodan's default: 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke test: patch 32, 64 samples")
    args = parser.parse_args()
    patches, samples = ([32], 64) if args.quick else (args.patches, args.samples)
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="bench-patch-share-") as scratch:
        pages = region_masks(Path(scratch))
    region = sum(masks[0][:TRAIN_ROWS].size for masks in pages)
    page_share = [sum(int(masks[k].sum()) for masks in pages) / region for k in range(len(LAYER_NAMES))]
    rows = []
    for patch in patches:
        mine, theirs = ours(pages, patch, samples, args.seed), paco(pages, patch, samples, args.seed)
        for k, name in enumerate(LAYER_NAMES):
            rows.append(
                [
                    f"{patch}x{patch}",
                    name,
                    f"{page_share[k]:.3f}",
                    f"{mine[k]:.3f}",
                    f"{theirs[k]:.3f}",
                    f"{mine[k] / theirs[k]:.2f}" if theirs[k] and not np.isnan(theirs[k]) else "-",
                ]
            )
    print_table(["patch", "layer", "page share", "ours: target share", "paco: target share", "ours / paco"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
