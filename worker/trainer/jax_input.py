"""What ``fit`` reads on Keras' JAX backend: uint8 batches, converted to float32 on the device.

There is no ``tf.data`` on JAX. :class:`DeviceBatches` is a Keras ``PyDataset`` over a
:class:`~worker.trainer.dataset.PatchDataset` (or the rest of an interrupted epoch): each item
is cut from the page as uint8 patches and bool masks (a quarter of float32's bytes to move),
put on the device (sharded over the replicas' devices when a ``keras.distribution`` is
active), and turned into the network's input there by one jitted function,
:func:`device_network_batch`: the same float32 values, bit for bit, as
:func:`~worker.trainer.dataset.to_network_batch` (a lookup in
:data:`~worker.trainer.dataset.INPUT_LOOKUP`, not a division XLA might rewrite).

JAX dispatches asynchronously, so while the device trains on one batch Python cuts the next:
that only holds while no callback waits for a step's results (``LayerLoop`` checks for a stop
request in ``on_train_batch_begin`` for this reason).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from worker.trainer._keras import keras
from worker.trainer.dataset import INPUT_LOOKUP, PatchDataset, RawBatch, RemainingBatches

__all__ = ["DeviceBatches", "device_network_batch"]


@jax.jit
def device_network_batch(patches: jax.Array, masks: jax.Array, *weights: jax.Array) -> tuple[jax.Array, ...]:
    """A raw batch on the device as the network trains on it: ``x`` float32 ``(b, ph, pw, 3)``,
    ``y`` float32 ``(b, ph, pw, 1)``, the weights unchanged."""
    x = jnp.asarray(INPUT_LOOKUP)[patches]
    y = masks.astype(jnp.float32)[..., jnp.newaxis]
    return (x, y, *weights)


def to_device(raw: RawBatch) -> tuple[jax.Array, ...]:
    """``raw``'s arrays on the device, split along the batch over the active distribution's devices."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return tuple(jax.device_put(np.asarray(part)) for part in raw)
    return tuple(jax.device_put(part, distribution.get_data_layout(part.shape).backend_layout) for part in raw)


class DeviceBatches(keras.utils.PyDataset):  # type: ignore[misc]
    """The batches of ``source`` in its order at the time each is read (see the module docstring).

    Keras reads the items in order, once per epoch, after the callbacks' ``on_epoch_begin``;
    reading one changes nothing, so Keras may also read the first to build the model.
    """

    def __init__(self, source: PatchDataset | RemainingBatches) -> None:
        super().__init__()  # read in the training thread: the order changes only between epochs
        self._source = source

    @property
    def num_batches(self) -> int:
        return len(self._source)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return tuple(device_network_batch(*to_device(self._source.raw_item(index))))
