"""Where and how a layer trains: the ``tf.distribute`` strategy and the precision policy.

The historic job could ask Slurm for 4 GPUs but trained on one. Here every visible GPU
trains: with more than one, :func:`plan_training` picks ``tf.distribute.MirroredStrategy``
(one replica per GPU, gradients all-reduced every step); with one GPU or none, TensorFlow's
default strategy (the GPU if there is one, else the CPU). ``TrainSettings.strategy``
overrides the choice: ``"mirrored"``, ``"default"``, or a tuple of device names for
``MirroredStrategy(devices=...)`` (tests force ``("/cpu:0",)`` on a CPU-only machine).

**Batch size.** ``TrainSettings.batch_size`` (Rodan's "Batch size", 16 by default) is the
batch of *one replica*, as it was on the single GPU the original trained on. Each step
therefore takes ``batch_size * replicas`` patches (the *global* batch), split evenly
across the replicas, and an epoch has ``ceil(train samples / global batch)`` steps. The
loss is averaged over the global batch, so the gradient is that of a ``batch_size *
replicas`` batch: with 4 GPUs an epoch has a quarter of the steps of a 1-GPU epoch. The
learning rate is not scaled. The last batch of an epoch is topped up to a multiple of the
replicas with a few of its own patches, so that every replica gets an equal share (see
:class:`worker.trainer.dataset.PatchDataset`).

**Mixed precision.** With a GPU (``TrainSettings.mixed_precision == "auto"``) or with
``"on"``, the model is built under Keras' ``mixed_float16`` policy: layers compute in
float16 and keep float32 variables, the final sigmoid layer is float32 (so the
probabilities and the binary cross-entropy are float32), and ``compile`` wraps Adam in a
``LossScaleOptimizer`` (Keras 3 does so for a ``mixed_float16`` model). ``"auto"`` leaves
the CPU in float32: float16 convolutions are slow there (``mixed_float16`` trained 6.5 times
slower than float32 on the project's 2-core CPU; on a CPU with AVX512-FP16 and AMX, TensorFlow
2.21 with its default oneDNN kernels, 26 times: 21 s instead of 0.8 s for 256 32x32 patches, and
3 times with ``TF_ENABLE_ONEDNN_OPTS=0``, which also made float32 slower there). ``"bfloat16"`` (opt-in, never chosen by
``"auto"``) builds under ``mixed_bfloat16`` instead, with no loss scaling: on that CPU (it
has AVX-512 BF16) it trained 1.75 times faster than float32 at 64x64 and 256x256, and a
4-layer 256x256 run peaked at 3.9 GB instead of 6.1 (``benchmarks/bench_throughput.py``,
``bench_memory.py``); its effect on the trained models' accuracy has not been evaluated.

The saved ``.hdf5`` never carries the policy: :func:`worker.trainer.saving.save_model`
writes the best weights (float32 variables) into a freshly built float32 model, which loads
and predicts float32 anywhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from worker.trainer._tf import keras
from worker.trainer.model import build_sae, compile_sae
from worker.trainer.settings import MIXED_PRECISION_CHOICES, STRATEGY_CHOICES, TrainSettings

log = logging.getLogger(__name__)

#: The Keras dtype policy of a mixed-precision model ("auto" on a GPU, "on").
MIXED_POLICY = "mixed_float16"
#: The policy of ``mixed_precision="bfloat16"``.
BFLOAT16_POLICY = "mixed_bfloat16"

__all__ = [
    "BFLOAT16_POLICY",
    "MIXED_POLICY",
    "MIXED_PRECISION_CHOICES",
    "STRATEGY_CHOICES",
    "TrainingPlan",
    "dtype_policy",
    "gpu_devices",
    "make_strategy",
    "plan_training",
    "precision_policy",
    "strategy_name",
    "trained_optimizer_variables",
]


def _tf() -> Any:
    import tensorflow as tf  # the only backend the trainer runs on (see worker.trainer._tf)

    return tf


def gpu_devices() -> list[str]:
    """The names of the GPUs TensorFlow sees (logical devices, e.g. ``/device:GPU:0``)."""
    return [device.name for device in _tf().config.list_logical_devices("GPU")]


def make_strategy(spec: str | Sequence[str], gpus: int) -> Any:
    """The ``tf.distribute.Strategy`` for ``spec`` (see ``TrainSettings.strategy``).

    ``"auto"`` is ``MirroredStrategy()`` over all GPUs when there are more than one, the
    default strategy otherwise; ``"mirrored"`` is ``MirroredStrategy()`` whatever the GPUs
    (on a CPU-only machine: one replica on the CPU); ``"default"`` the default strategy; a
    sequence of device names ``MirroredStrategy(devices=list(spec))``.
    """
    tf = _tf()
    if not isinstance(spec, str):
        return tf.distribute.MirroredStrategy(devices=list(spec))
    if spec == "auto":
        spec = "mirrored" if gpus > 1 else "default"
    if spec == "mirrored":
        return tf.distribute.MirroredStrategy()
    if spec == "default":
        return tf.distribute.get_strategy()
    raise ValueError(f"unknown strategy {spec!r}; expected one of {STRATEGY_CHOICES} or a list of devices")


@functools.cache
def _strategy(spec: str | tuple[str, ...]) -> Any:
    # One per spec and process: a MirroredStrategy is reusable, and creating one per layer
    # would only repeat its set-up (and its log lines).
    return make_strategy(spec, len(gpu_devices()))


def strategy_name(strategy: Any) -> str:
    """``"MirroredStrategy"``, or ``"default"`` for TensorFlow's default strategy."""
    name = type(strategy).__name__
    return "default" if name.startswith("_Default") else name


def precision_policy(setting: str, gpus: int) -> str:
    """The Keras dtype policy for ``TrainSettings.mixed_precision`` with ``gpus`` GPUs visible.

    ``"auto"``: ``mixed_float16`` exactly when a GPU is visible, else ``float32``; ``"on"``
    and ``"off"`` force ``mixed_float16`` and ``float32``; ``"bfloat16"`` is ``mixed_bfloat16``.
    """
    policies = {"on": MIXED_POLICY, "off": "float32", "bfloat16": BFLOAT16_POLICY}
    if setting == "auto":
        return MIXED_POLICY if gpus > 0 else "float32"
    if setting in policies:
        return policies[setting]
    raise ValueError(f"unknown mixed_precision {setting!r}; expected one of {MIXED_PRECISION_CHOICES}")


@contextmanager
def dtype_policy(name: str) -> Iterator[None]:
    """Make ``name`` Keras' global dtype policy while the block runs, then restore the old one.

    Layers take the global policy when they are constructed, so a model built inside the
    block keeps it; models built later get the previous policy again.
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


@dataclass(frozen=True)
class TrainingPlan:
    """The strategy, the precision and the batch sizes of a training run."""

    strategy: Any
    policy: str  # "float32", MIXED_POLICY or BFLOAT16_POLICY
    per_replica_batch_size: int
    gpus: int

    @property
    def replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def global_batch_size(self) -> int:
        """The patches per step: the per-replica batch times the replicas."""
        return self.per_replica_batch_size * self.replicas

    @property
    def mixed_precision(self) -> bool:
        return self.policy != "float32"

    def describe(self) -> str:
        try:
            devices = ", ".join(self.strategy.extended.worker_devices)
        except RuntimeError:  # the default strategy has no device list: TensorFlow places ops
            devices = "/GPU:0" if self.gpus else "/CPU:0"
        return (
            f"{strategy_name(self.strategy)} strategy, {self.replicas} replica(s) on {devices}; "
            f"{self.gpus} GPU(s) visible; global batch {self.global_batch_size} "
            f"({self.per_replica_batch_size} per replica); dtype policy {self.policy}"
        )

    def build_model(self, height: int, width: int) -> Any:
        """A compiled SAE for ``height`` x ``width`` patches, made inside the strategy's scope.

        Its variables are created and its optimizer compiled under ``strategy.scope()`` (so
        a MirroredStrategy mirrors them on every replica) and under the plan's dtype policy.
        """
        with self.strategy.scope(), dtype_policy(self.policy):
            model = build_sae(height, width)
            compile_sae(model)
        return model


def plan_training(settings: TrainSettings) -> TrainingPlan:
    """Choose the strategy and precision for ``settings`` on this machine, and log them."""
    gpus = len(gpu_devices())
    plan = TrainingPlan(
        strategy=_strategy(settings.strategy),
        policy=precision_policy(settings.mixed_precision, gpus),
        per_replica_batch_size=settings.batch_size,
        gpus=gpus,
    )
    log.info("training with the %s", plan.describe())
    return plan


def trained_optimizer_variables(model: Any, values: list[Any] | None) -> list[Any] | None:
    """The Adam part of ``values``, a copy of ``model.optimizer.variables``.

    A mixed-precision model's optimizer is a ``LossScaleOptimizer`` whose ``variables``
    are its own (loss scale, step counter) followed by the wrapped Adam's. The saved file
    holds a plain Adam (see :mod:`worker.trainer.saving`), so only Adam's are kept.
    """
    if values is None:
        return None
    inner = getattr(model.optimizer, "inner_optimizer", None)
    if inner is None:
        return values
    return values[len(values) - len(inner.variables) :]
