"""The patchwise selectional auto-encoder (SAE) of Calvo-Zaragoza et al., as Rodan trains it."""

from __future__ import annotations

from typing import Any

from worker.trainer._keras import keras

#: Width of the first block; the others are multiples of it.
FILTERS = 32
LEARNING_RATE = 1e-4
#: Trainable parameters of the network; it is fully convolutional, so this does not depend
#: on the patch size.
PARAMETER_COUNT = 1_429_733


def _conv(filters: int, size: int, name: str) -> Any:
    return keras.layers.Conv2D(
        filters, size, activation="relu", padding="same", kernel_initializer="he_normal", name=name
    )


def build_sae(height: int | None, width: int | None) -> Any:
    """Return the uncompiled SAE for ``height`` x ``width`` RGB patches (``None``: any size).

    Two convolutions per level down (32, 64 filters, 2x2 max-pooling after each), a
    256-filter bottleneck of two convolutions, two up-sampling levels that each
    concatenate with the matching down level (U-Net style), and a 1x1 sigmoid output:
    one probability per pixel that it belongs to the layer (float32 even when the model is
    built under a mixed-precision policy). Layers are named (the
    original's were Keras' automatic names) so that every model, whenever it is built in
    the process, has the same layer and optimizer-variable names.
    """
    ff = FILTERS
    inputs = keras.Input(shape=(height, width, 3), name="image")
    conv1 = _conv(ff, 3, "conv1_1")(inputs)
    conv1 = _conv(ff, 3, "conv1_2")(conv1)
    pool1 = keras.layers.MaxPooling2D(pool_size=(2, 2), name="pool1")(conv1)
    conv2 = _conv(ff * 2, 3, "conv2_1")(pool1)
    conv2 = _conv(ff * 2, 3, "conv2_2")(conv2)
    pool2 = keras.layers.MaxPooling2D(pool_size=(2, 2), name="pool2")(conv2)

    conv3 = _conv(ff * 8, 3, "conv3")(pool2)
    conv7 = _conv(ff * 8, 3, "conv7")(conv3)

    up8 = keras.layers.UpSampling2D(size=(2, 2), name="up8")(conv7)
    up8 = _conv(ff * 4, 2, "up8_conv")(up8)
    merge8 = keras.layers.Concatenate(axis=3, name="merge8")([conv2, up8])
    conv8 = _conv(ff * 4, 3, "conv8_1")(merge8)
    conv8 = _conv(ff * 4, 3, "conv8_2")(conv8)

    up9 = keras.layers.UpSampling2D(size=(2, 2), name="up9")(conv8)
    up9 = _conv(ff * 2, 2, "up9_conv")(up9)
    merge9 = keras.layers.Concatenate(axis=3, name="merge9")([conv1, up9])
    conv9 = _conv(ff * 2, 3, "conv9_1")(merge9)
    conv9 = _conv(ff * 2, 3, "conv9_2")(conv9)
    conv9 = _conv(2, 3, "conv9_3")(conv9)
    # float32 whatever the global dtype policy: under mixed_float16 the probabilities, and so
    # the loss, stay float32 (under float32 this changes nothing, not even the saved config).
    outputs = keras.layers.Conv2D(1, 1, activation="sigmoid", name="probability", dtype="float32")(conv9)
    return keras.Model(inputs=inputs, outputs=outputs, name="sae")


#: The metric :func:`compile_sae` adds for training: the share of the pixels the model marks as the
#: layer (probability > 0.5). Keras logs it as ``val_predicted_share`` on the validation patches, where
#: it tells a model that marks almost no pixel as the layer (:func:`worker.trainer.callbacks.one_class`).
PREDICTED_SHARE = "predicted_share"


def _marked(y_true: Any, y_pred: Any) -> Any:
    """1 where the model marks a pixel as the layer, else 0 (what Keras' binary accuracy thresholds)."""
    return keras.ops.cast(keras.ops.greater(y_pred, 0.5), "float32")


def compile_sae(
    model: Any, *, weighted_accuracy: bool = False, learning_rate: float = LEARNING_RATE, predicted_share: bool = False
) -> None:
    """Compile ``model`` as the original does: Adam(1e-4), binary cross-entropy, accuracy.

    ``learning_rate`` is Adam's for training (:attr:`TrainSettings.learning_rate
    <worker.trainer.settings.TrainSettings>`); saved files are compiled with the original's 1e-4,
    which Rodan's trainer continues them with.

    ``weighted_accuracy`` computes accuracy with the batches' sample weights (Keras'
    ``weighted_metrics``): for training on several replicas, whose padded batches weigh
    their copies 0 (see :class:`worker.trainer.dataset.PatchDataset`). Without sample
    weights both are the same accuracy.

    ``predicted_share`` adds the :data:`PREDICTED_SHARE` metric (for training only: a saved file
    is compiled with the built-in metrics alone, which Rodan's Keras loads without custom objects).
    """
    accuracy: list[Any] = ["accuracy"]
    if predicted_share:
        accuracy.append(keras.metrics.MeanMetricWrapper(_marked, name=PREDICTED_SHARE))
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
        loss="binary_crossentropy",
        metrics=None if weighted_accuracy else accuracy,
        weighted_metrics=accuracy if weighted_accuracy else None,
    )


def get_sae(height: int, width: int) -> Any:
    """Return the SAE, compiled for training (the original's ``get_sae``)."""
    model = build_sae(height, width)
    compile_sae(model)
    return model
