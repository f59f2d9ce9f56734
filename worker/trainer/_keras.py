"""Import Keras once, on the backend the worker environment chose, with start-up chatter turned down.

Every trainer module that needs Keras imports it from here, so that the backend is chosen
(:func:`worker.trainer.backend.configure`: ``KERAS_BACKEND``, else what is installed) before
Keras is first imported. On TensorFlow it also hides TensorFlow's INFO and WARNING lines
(CPU-feature and CUDA probes); that has no effect if the process imported TensorFlow earlier,
and TensorFlow 2.21 still prints its oneDNN notice once or twice before its logging is set up.
On JAX, TensorFlow is never imported.
"""

from __future__ import annotations

import os

from worker.trainer.backend import configure

BACKEND = configure()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402  (the backend must be chosen first)

if keras.backend.backend() != BACKEND:  # Keras was imported before this module, on another backend
    raise ImportError(
        f"Keras runs on {keras.backend.backend()}, but this worker chose {BACKEND}: "
        "import worker.trainer before keras, or set KERAS_BACKEND"
    )
if BACKEND == "tensorflow":
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
else:
    from worker.trainer.backend import use_compilation_cache

    use_compilation_cache()

__all__ = ["BACKEND", "keras"]
