"""Import Keras (and TensorFlow, its backend here) once, with their start-up chatter turned down.

Every trainer module that needs Keras imports it from here, so the environment variable
is set before TensorFlow's C++ runtime logs anything. It hides TensorFlow's INFO and
WARNING lines (CPU-feature and CUDA probes); it has no effect if the process imported
TensorFlow earlier, and TensorFlow 2.21 still prints its oneDNN notice once or twice
before its logging is set up.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")

__all__ = ["keras"]
