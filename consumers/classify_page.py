"""Classify a page with Paco_classifier's own ``process_image_msae``, as Rodan 3.x does.

Run by :func:`consumers.classify` with a consumer environment's Python (3.7 syntax) and
``PYTHONPATH`` set to Paco_classifier's source. Rodan's classifier job reads the page with
``cv2.imread`` and calls ``process_image_msae(image, model_paths, height, width, mode="logical")``
with the models in port order (background first); this script does the same and writes the label
image (``uint8``, one label per pixel: the index of the model that won) to ``OUT.npy``.

Usage: classify_page.py PAGE.png OUT.npy HEIGHT WIDTH MODEL.hdf5 [MODEL.hdf5 ...]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import cv2
import numpy as np
import tensorflow as tf
from Paco_classifier import recognition_engine


def main(argv: list[str]) -> None:
    page, out, height, width, models = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4:]
    image = cv2.imread(page, cv2.IMREAD_COLOR)
    if image is None:
        raise SystemExit("cv2 could not read " + page)
    with contextlib.redirect_stdout(sys.stderr):  # Paco prints its progress
        labels = recognition_engine.process_image_msae(image, models, height, width, mode="logical")
    np.save(out, np.asarray(labels, dtype=np.uint8))
    print(json.dumps({"tensorflow": tf.__version__, "python": sys.version.split()[0], "shape": list(labels.shape)}))


if __name__ == "__main__":
    main(sys.argv[1:])
