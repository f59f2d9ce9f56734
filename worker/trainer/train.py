"""Train one SAE per layer and save each layer's best epoch as a legacy Keras HDF5 file."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.trainer._tf import keras
from worker.trainer.callbacks import MONITOR, BestEpoch, EpochCallback, EpochReporter
from worker.trainer.dataset import PatchDataset, split_validation
from worker.trainer.distribute import plan_training, trained_optimizer_variables
from worker.trainer.errors import TrainingInputError
from worker.trainer.page import Page
from worker.trainer.rundir import RunDirectory
from worker.trainer.sampling import Centres, centre_ranges, sample_centres
from worker.trainer.saving import LabelResult, model_file_names, save_model
from worker.trainer.settings import TrainSettings

log = logging.getLogger(__name__)


def check_page(page: Page, settings: TrainSettings) -> None:
    """Raise TrainingInputError for a page the settings cannot train on."""
    image = page.image
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"page.image must be uint8 (H, W, 3), not {image.dtype} {image.shape}")
    if not page.masks:
        raise TrainingInputError("the page has no layers to train")
    height, width = page.height, page.width
    for label, mask in page.masks.items():
        if mask.ndim != 2:
            raise ValueError(f"the mask of layer {label!r} has shape {mask.shape}, not (height, width)")
        if mask.shape != (height, width):
            raise TrainingInputError(
                f"layer {label!r} is {mask.shape[1]}x{mask.shape[0]} pixels but the image is {width}x{height}"
            )
    ph, pw = settings.patch_height, settings.patch_width
    if ph > height or pw > width:
        raise TrainingInputError(
            f"the patch ({pw}x{ph} pixels) is larger than the page ({width}x{height}); "
            "choose a smaller patch width and height"
        )
    rows, cols = centre_ranges(height, width, ph, pw)
    if len(rows) == 0 or len(cols) == 0:
        raise TrainingInputError(
            f"the page ({width}x{height} pixels) is too small for {pw}x{ph} patches: patches are "
            f"centred at least one patch width/height from the border, so the page must be at least "
            f"{2 * pw + 2}x{2 * ph + 2}; choose a smaller patch width and height"
        )
    for label, mask in page.masks.items():
        if not np.any(mask):
            raise TrainingInputError(
                f"layer {label!r} has no pixels inside the selected regions; "
                "paint some of it there or leave the layer out"
            )


def minimum_samples(validation_split: float) -> int:
    """The fewest samples that leave at least one for training and one for validation."""
    n = 2
    while True:
        train, validation = split_validation(np.zeros((n, 2), dtype=np.int64), validation_split)
        if len(train) and len(validation):
            return n
        n += 1


def check_samples(centres: dict[str, Centres], settings: TrainSettings) -> None:
    """Raise TrainingInputError if a layer got too few samples to train and validate."""
    needed = minimum_samples(settings.validation_split)
    for label, found in centres.items():
        if len(found) < needed:
            raise TrainingInputError(
                f"only {len(found)} patches could be sampled for layer {label!r}, at least {needed} are "
                "needed (some are held out for validation). Patches are centred on the layer's pixels "
                "away from the page border and on about one pixel in a hundred: paint more of the "
                "layer (and of every other layer, since all share the smallest layer's budget), raise "
                "the maximum number of samples per label, or choose a smaller patch size"
            )


def train_label(
    page: Page,
    label: str,
    centres: Centres,
    settings: TrainSettings,
    *,
    shuffle_rng: np.random.Generator,
    init_seed: int | None = None,
    on_epoch: EpochCallback | None = None,
    callbacks: Sequence[Any] = (),
) -> LabelResult:
    """Train a fresh SAE on ``label``'s samples and return its best epoch.

    The first ``1 - validation_split`` of ``centres`` train (reshuffled every epoch), the
    rest validate, ``settings.batch_size`` patches per replica and step (see
    :mod:`worker.trainer.distribute` for the strategy and the precision); at most ``settings.epochs`` epochs with
    early stopping on val_accuracy. ``init_seed`` seeds Keras (weight initialisation);
    ``callbacks`` are extra Keras callbacks, run after the trainer's own.
    """
    train_centres, validation_centres = split_validation(centres, settings.validation_split)
    if len(train_centres) == 0 or len(validation_centres) == 0:
        check_samples({label: centres}, settings)
    ph, pw = settings.patch_height, settings.patch_width
    if init_seed is not None:
        keras.utils.set_random_seed(init_seed)
    plan = plan_training(settings)  # every GPU; batch_size per replica, plan.global_batch_size per step
    model = plan.build_model(ph, pw)  # created and compiled inside plan.strategy.scope()
    mask = np.asarray(page.masks[label], dtype=bool)
    batch = plan.global_batch_size
    replicas = plan.replicas  # every batch a multiple of this: an equal share per replica
    train_data = PatchDataset(
        page.image, mask, train_centres, ph, pw, batch, shuffle_rng=shuffle_rng, multiple_of=replicas
    )
    validation_data = PatchDataset(page.image, mask, validation_centres, ph, pw, batch, multiple_of=replicas)
    best = BestEpoch(keep_optimizer=settings.include_optimizer)
    stopper = keras.callbacks.EarlyStopping(monitor=MONITOR, patience=settings.patience, mode="max")
    reporter = EpochReporter(label, len(train_centres), on_epoch)
    log.info("layer %r: training on %d patches, validating on %d", label, len(train_centres), len(validation_centres))
    history = model.fit(
        train_data,
        validation_data=validation_data,
        epochs=settings.epochs,
        callbacks=[best, stopper, reporter, *callbacks],
        verbose=0,
    )
    weights, optimizer_variables = best.weights, trained_optimizer_variables(model, best.optimizer_variables)
    if weights is None:  # no epoch reported val_accuracy: keep what training ended with
        weights = model.get_weights()
        if settings.include_optimizer:
            optimizer_variables = trained_optimizer_variables(
                model, [np.array(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables]
            )
    values = {key: [float(v) for v in series] for key, series in history.history.items()}
    return LabelResult(
        label=label,
        weights=weights,
        optimizer_variables=optimizer_variables,
        best_epoch=best.best_epoch,
        best_val_accuracy=best.best,
        epochs_run=len(values.get("loss", [])),
        train_samples=len(train_centres),
        validation_samples=len(validation_centres),
        history=values,
    )


def train_page(
    page: Page,
    settings: TrainSettings,
    out_dir: Path,
    on_epoch: EpochCallback | None = None,
    run_dir: RunDirectory | None = None,
) -> dict[str, Path]:
    """Train one model per layer of ``page`` (in ``page.masks`` order) into ``out_dir``.

    Samples every layer first (so input errors surface before any training), then trains
    and saves each in turn. Returns label -> path of its ``.hdf5`` file, named after the
    label (see :func:`model_file_names`). ``on_epoch`` receives one dict per epoch and
    layer with the keys in :data:`EPOCH_KEYS`.

    With ``settings.seed`` the sampling, the shuffling and the weight initialisation are
    reproducible (the seed goes to ``keras.utils.set_random_seed``, which also seeds
    Python's and NumPy's global generators).

    With ``run_dir`` the settings go to its settings.json first, each layer's fit writes
    TensorBoard summaries to ``run_dir.tensorboard_dir(label)``, every epoch's record is
    kept there too, and after each layer its history files and curves are rewritten.
    """
    if run_dir is not None:  # first, so that a run that fails on its input still says how it was set
        run_dir.write_settings(dataclasses.asdict(settings))
        on_epoch = run_dir.epoch_callback(on_epoch)
    check_page(page, settings)
    labels = list(page.masks)
    sampling_seed, *label_seeds = np.random.SeedSequence(settings.seed).spawn(1 + len(labels))
    centres = sample_centres(
        page.masks,
        settings.patch_height,
        settings.patch_width,
        settings.max_samples_per_label,
        np.random.default_rng(sampling_seed),
    )
    check_samples(centres, settings)
    names = model_file_names(labels)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for label, label_seed in zip(labels, label_seeds, strict=True):
        shuffle_seed, init_seed = label_seed.spawn(2)
        result = train_label(
            page,
            label,
            centres[label],
            settings,
            shuffle_rng=np.random.default_rng(shuffle_seed),
            init_seed=None if settings.seed is None else int(init_seed.generate_state(1)[0]),
            on_epoch=on_epoch,
            callbacks=() if run_dir is None else run_dir.keras_callbacks(label),
        )
        paths[label] = save_model(result, out_dir / names[label], settings)
        log.info(
            "layer %r: best val_accuracy %.4f at epoch %d of %d, saved to %s",
            label, result.best_val_accuracy, result.best_epoch, result.epochs_run, paths[label],
        )  # fmt: skip
        if run_dir is not None:
            run_dir.write_artifacts()
    return paths
