"""Where and how a layer trains: the strategy (the devices of one step) and the precision policy.

On JAX (see :mod:`worker.trainer.backend` and ``docs/design-jax.md``) the strategy is a
:class:`JaxReplicas` (``keras.distribution.DataParallel`` over several devices), with the same
choices, batch sharing and padding as below; ``plan.training()`` is the context ``fit`` runs in.

The historic job could ask Slurm for 4 GPUs but trained on one. Here every visible GPU
trains: with more than one, :func:`plan_training` picks ``tf.distribute.MirroredStrategy``
(one replica per GPU, gradients all-reduced every step); with one GPU or none, TensorFlow's
default strategy (the GPU if there is one, else the CPU). ``TrainSettings.strategy``
overrides the choice: ``"mirrored"``, ``"default"``, or a tuple of device names for
``MirroredStrategy(devices=...)`` (tests use logical CPU devices on a CPU-only machine).

**Batch size: the global batch.** ``TrainSettings.batch_size`` (Rodan's "Batch size", 16 by
default) is the number of patches of one training step, as on the single GPU the
original trainer used; with ``n`` replicas each computes ``batch_size / n`` of them and the gradients
are summed, the loss being each replica's mean divided by ``n``: the gradient of the
whole batch's mean. An epoch has ``ceil(train samples / batch_size)`` steps whatever the
GPUs, so adding GPUs does not change what is trained (only the order of floating-point
additions). The replicas must share a batch evenly, so ``"auto"`` and ``"mirrored"`` use the
most GPUs that divide the batch (3 GPUs and a batch of 16: 2 of them, said in the log); a
tuple of devices that does not divide it is refused. The last batch of an epoch, when it
is smaller, is topped up to a multiple of the replicas with copies of its own patches
that weigh nothing, its real patches weighing ``padded / real`` each, so its loss and
gradient are those of its real patches; in validation batches each real patch weighs 1 and
accuracy is weighted, so ``val_accuracy``, which picks the best epoch and stops early,
counts every validation patch once (see :class:`worker.trainer.dataset.PatchDataset`).
``tests/test_trainer_scaling.py`` trains the same layer on one and on two replicas (logical
CPUs) and gets the same weights and the same ``val_accuracy``. Only the reported epoch
averages of the training loss and accuracy and of ``val_loss`` count the copies (at most
``replicas - 1`` patches per epoch), so with several GPUs they can differ in the last digits.

**Precision: bfloat16 where GPUs compute it, else float32.** ``mixed_precision`` is ``"auto"``
by default (``HPC_MIXED_PRECISION`` on the bridge): bfloat16 on GPUs of compute capability 8.0
and up, float32 (the original trainer's precision) on CPUs and older GPUs
(:func:`resolve_precision`, when the run starts; a resumed run keeps the precision its
checkpoint records). The default was decided by measurement: over 3 seeds per precision, at a
setting where float32 is not at its ceiling, bfloat16's best val_accuracy lands within float32's
own spread (``benchmarks/README.md``, "Precision"), and on an H200 a bfloat16 step is 2.3-4.1x
faster. ``"off"`` keeps float32 everywhere, ``"float16"`` builds the model under Keras'
``mixed_float16`` policy (float16 computation, float32 variables, a float32 sigmoid layer
so the probabilities and the loss stay float32, and a ``LossScaleOptimizer`` around
Adam), ``"bfloat16"`` under ``mixed_bfloat16`` (no loss scaling). What each policy does to
accuracy and speed, on GPUs and on CPUs, is measured in ``benchmarks/README.md`` ("Precision",
"Training throughput"), with the commands that reproduce it.

The saved ``.hdf5`` never carries the policy: :func:`worker.trainer.saving.save_model`
writes the best weights (float32 variables) into a freshly built float32 model, which loads
and predicts float32 anywhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from worker.trainer._keras import BACKEND, keras
from worker.trainer.errors import TrainingInputError
from worker.trainer.model import LEARNING_RATE, build_sae, compile_sae
from worker.trainer.settings import MIXED_PRECISION_CHOICES, STRATEGY_CHOICES, TrainSettings

log = logging.getLogger(__name__)

#: The Keras dtype policy of ``mixed_precision="float16"``.
MIXED_POLICY = "mixed_float16"
#: The policy of ``mixed_precision="bfloat16"``.
BFLOAT16_POLICY = "mixed_bfloat16"

__all__ = [
    "BFLOAT16_POLICY",
    "MIXED_POLICY",
    "MIXED_PRECISION_CHOICES",
    "STRATEGY_CHOICES",
    "JaxReplicas",
    "TrainingPlan",
    "dtype_policy",
    "gpu_devices",
    "make_strategy",
    "plan_training",
    "precision_policy",
    "replica_devices",
    "resolve_precision",
    "strategy_name",
    "trained_optimizer_variables",
]


def _tf() -> Any:
    import tensorflow as tf  # only on the TensorFlow backend (see worker.trainer.backend)

    return tf


def gpu_devices() -> list[str]:
    """The names of the GPUs the backend sees: TensorFlow's logical devices (``/device:GPU:0``)
    or, on JAX, Keras' device names (``gpu:0``)."""
    if BACKEND == "jax":
        try:
            return [str(d) for d in keras.distribution.list_devices("gpu")]
        except RuntimeError:  # JAX has no GPU platform here
            return []
    return [device.name for device in _tf().config.list_logical_devices("GPU")]


def jax_device_name(name: str) -> str:
    """A device name as Keras' JAX distribution takes it: ``/device:CPU:1`` or ``/cpu:1`` -> ``cpu:1``."""
    kind, _, index = name.rsplit("/", 1)[-1].removeprefix("device:").partition(":")
    return f"{kind.lower()}:{index or 0}"


class JaxReplicas:
    """On JAX, what a ``tf.distribute`` strategy is on TensorFlow: the devices one step runs on.

    With several devices, a ``keras.distribution.DataParallel`` over them: the variables are
    replicated, every batch is split along its first axis, and the step is one SPMD program
    whose gradient is that of the whole batch's mean, as with a MirroredStrategy.
    :meth:`scope` makes it Keras' distribution while a model is built and while it trains.
    With one device (or none named: JAX's default device), no distribution.
    """

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = [jax_device_name(d) for d in devices]
        self.distribution = keras.distribution.DataParallel(devices=self.devices) if len(self.devices) > 1 else None

    @property
    def num_replicas_in_sync(self) -> int:
        return max(1, len(self.devices))

    def scope(self) -> AbstractContextManager[Any]:
        return self.distribution.scope() if self.distribution is not None else nullcontext()


def replica_devices(gpus: Sequence[str], batch_size: int) -> list[str]:
    """The first GPUs of ``gpus``, as many as possible while they share ``batch_size`` evenly."""
    count = max((n for n in range(1, len(gpus) + 1) if batch_size % n == 0), default=0)
    return list(gpus[:count])


def make_strategy(spec: str | Sequence[str], gpus: Sequence[str], batch_size: int) -> Any:
    """The ``tf.distribute.Strategy`` for ``spec`` (see ``TrainSettings.strategy``) and ``batch_size``.

    ``gpus`` are the GPUs' device names. ``"auto"`` is a MirroredStrategy over the most GPUs
    that share the batch evenly when that is more than one, the default strategy otherwise;
    ``"mirrored"`` is a MirroredStrategy over those GPUs (on a machine without GPUs: one
    replica on the CPU); ``"default"`` the default strategy; a sequence of device names
    ``MirroredStrategy(devices=list(spec))``, which must divide the batch.
    """
    if not isinstance(spec, str):
        if batch_size % len(spec):
            raise TrainingInputError(
                f"a batch of {batch_size} patches cannot be shared evenly by the {len(spec)} devices {list(spec)}"
            )
        return JaxReplicas(spec) if BACKEND == "jax" else _tf().distribute.MirroredStrategy(devices=list(spec))
    if spec not in STRATEGY_CHOICES:
        raise ValueError(f"unknown strategy {spec!r}; expected one of {STRATEGY_CHOICES} or a list of devices")
    if spec == "default":
        return JaxReplicas([]) if BACKEND == "jax" else _tf().distribute.get_strategy()
    devices = replica_devices(gpus, batch_size)
    if len(devices) < len(gpus):
        log.warning(
            "a batch of %d patches is shared evenly by %d of the %d GPUs: training on %s",
            batch_size, len(devices), len(gpus), ", ".join(devices),
        )  # fmt: skip
    if BACKEND == "jax":  # "mirrored" without GPUs: JAX's default device
        return JaxReplicas(devices)
    tf = _tf()
    if spec == "auto":
        return tf.distribute.MirroredStrategy(devices=devices) if len(devices) > 1 else tf.distribute.get_strategy()
    return tf.distribute.MirroredStrategy(devices=devices or None)


@functools.cache
def _strategy(spec: str | tuple[str, ...], batch_size: int) -> Any:
    # One per spec, batch size and process: a MirroredStrategy is reusable, and creating one
    # per layer would only repeat its set-up (and its log lines).
    return make_strategy(spec, gpu_devices(), batch_size)


def strategy_name(strategy: Any) -> str:
    """``"MirroredStrategy"`` or ``"DataParallel"`` (JAX), or ``"default"`` for one device."""
    if isinstance(strategy, JaxReplicas):
        return "default" if strategy.distribution is None else "DataParallel"
    name = type(strategy).__name__
    return "default" if name.startswith("_Default") else name


#: GPUs from this compute capability on (NVIDIA Ampere and later) compute in bfloat16 natively.
BFLOAT16_CAPABILITY = (8, 0)


def gpu_capabilities() -> list[tuple[int, int]]:
    """The compute capability of every GPU the backend sees, e.g. ``[(9, 0)]`` (none: ``[]``)."""
    found: list[tuple[int, int]] = []
    if BACKEND == "jax":
        import jax

        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            return []
        for device in gpus:
            major, _, minor = str(getattr(device, "compute_capability", "0.0")).partition(".")
            found.append((int(major), int(minor or 0)))
        return found
    tf = _tf()
    for device in tf.config.list_physical_devices("GPU"):
        capability = tf.config.experimental.get_device_details(device).get("compute_capability")
        found.append(tuple(capability) if capability else (0, 0))
    return found


def resolve_precision(setting: str) -> str:
    """``TrainSettings.mixed_precision`` as a run starts with it: ``"auto"`` becomes ``"bfloat16"``
    where every GPU the backend sees has :data:`BFLOAT16_CAPABILITY` or more, else ``"off"``
    (float32; CPUs, older GPUs). Other values stay as they are."""
    if setting != "auto":
        return setting
    capabilities = gpu_capabilities()
    return "bfloat16" if capabilities and min(capabilities) >= BFLOAT16_CAPABILITY else "off"


def precision_policy(setting: str) -> str:
    """The Keras dtype policy for ``TrainSettings.mixed_precision``: ``"off"`` is float32."""
    policies = {"off": "float32", "float16": MIXED_POLICY, "bfloat16": BFLOAT16_POLICY}
    setting = resolve_precision(setting)
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
    global_batch_size: int  # the patches of one step (TrainSettings.batch_size), shared by the replicas
    gpus: int
    learning_rate: float = LEARNING_RATE

    @property
    def replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def per_replica_batch_size(self) -> int:
        """The patches each replica computes per step (the strategy divides the batch)."""
        return self.global_batch_size // self.replicas

    @property
    def mixed_precision(self) -> bool:
        return self.policy != "float32"

    def training(self) -> AbstractContextManager[Any]:
        """The context ``fit`` runs in: on JAX the distribution's scope (Keras reads it while it
        trains); on TensorFlow nothing (a model keeps the strategy it was built under)."""
        return self.strategy.scope() if isinstance(self.strategy, JaxReplicas) else nullcontext()

    def describe(self) -> str:
        if isinstance(self.strategy, JaxReplicas):
            devices = ", ".join(self.strategy.devices) or ("gpu:0" if self.gpus else "cpu:0")
        else:
            try:
                devices = ", ".join(self.strategy.extended.worker_devices)
            except RuntimeError:  # the default strategy has no device list: TensorFlow places ops
                devices = "/GPU:0" if self.gpus else "/CPU:0"
        return (
            f"{BACKEND} backend, {strategy_name(self.strategy)} strategy, {self.replicas} replica(s) on {devices}; "
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
            # weighted accuracy: padded batches (see the module docstring)
            compile_sae(
                model, weighted_accuracy=self.replicas > 1, learning_rate=self.learning_rate, predicted_share=True
            )
        return model


def plan_training(settings: TrainSettings) -> TrainingPlan:
    """Choose the strategy and precision for ``settings`` on this machine, and log them."""
    plan = TrainingPlan(
        strategy=_strategy(settings.strategy, settings.batch_size),
        policy=precision_policy(settings.mixed_precision),
        global_batch_size=settings.batch_size,
        gpus=len(gpu_devices()),
        learning_rate=settings.learning_rate,
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
