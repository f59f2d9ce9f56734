"""Import TensorFlow and Keras once, with their start-up chatter turned down.

Every trainer module that needs Keras imports it from here, so the environment variable
is set before TensorFlow's C++ runtime first logs anything (it has no effect if the
process imported TensorFlow earlier).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide C++ INFO and WARNING lines (oneDNN, CUDA probes)

import keras
import tensorflow as tf

tf.get_logger().setLevel("ERROR")

__all__ = ["keras", "tf"]
