"""Train one SAE per layer and save each layer's best epoch as a legacy Keras HDF5 file.

**Pages.** :func:`train_pages` trains each layer over several pages at once (Rodan 3.x's
samples): samples drawn across the pages (:func:`~worker.trainer.sampling.sample_pages_centres`),
every page holding out its own last part for validation, batches cut from the uint8 pages as
they are needed (one BGR copy of every page for the whole run, never a copy per layer), and
optional starting models (:mod:`worker.trainer.starting`). :func:`train_page` is its one-page
case, unchanged: the same samples, weights, files and checkpoints as before.

**Checkpoints.** With a :class:`~worker.trainer.checkpoint.CheckpointStore`,
:func:`train_page` saves the whole state of the run (see
:mod:`worker.trainer.checkpoint`) before the first layer, at every epoch end and after
every layer, and a later call with a store holding a checkpoint resumes from it:
finished layers are not trained again (their models come from the store), the layer in
progress continues at the saved epoch and batch with the saved weights, optimizer,
metrics, callback states, sample order and shuffling generator, and the run ends as an
uninterrupted one would: the same epochs per layer, the same samples, the same
history and (on this CPU, where TensorFlow's kernels are deterministic; see
tests/test_resume.py) bit-identical weights.

With ``stop_requested`` (polled after every training batch, at every epoch end and
before every layer), training stops as soon as it returns True: at the next batch
boundary it saves a checkpoint in the middle of the epoch and raises
:class:`~worker.trainer.checkpoint.TrainingInterrupted`, without validating the partial
epoch. (When the flag comes during an epoch's last batch or its validation, the epoch
ends first and the checkpoint is the epoch end's.)

A layer resumed part-way is trained in two fits: the rest of the interrupted epoch
(``fit(initial_epoch=e, epochs=e + 1)`` over the remaining batches, with the metrics'
running sums restored so that the epoch's loss and accuracy cover all of it), then the
remaining epochs. Resuming on a node with another number of GPUs continues from the same
sample of the epoch with the new global batch, which is sound but no longer identical.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from worker.trainer._keras import BACKEND, keras
from worker.trainer.callbacks import (
    BestEpoch,
    EarlyStopper,
    EpochCallback,
    EpochReporter,
    EpochShuffle,
    FirstEpochGuard,
    FreshStart,
    LayerCallback,
    one_class,
    variable_values,
)
from worker.trainer.checkpoint import CheckpointStore, LayerState, TrainingInterrupted
from worker.trainer.dataset import PatchDataset, network_order, split_validation, training_input
from worker.trainer.distribute import (
    TrainingPlan,
    dtype_policy,
    plan_training,
    resolve_precision,
    trained_optimizer_variables,
)
from worker.trainer.errors import TrainingInputError
from worker.trainer.journal import CheckpointJournal, Journal, NoCheckpoints, NoRunDirectory, RunOutputs, SaveLayer
from worker.trainer.model import build_sae
from worker.trainer.page import Page
from worker.trainer.rundir import RunDirectory
from worker.trainer.sampling import Centres, centre_ranges, run_centres, run_pages_centres
from worker.trainer.saving import LabelResult, model_file_names, save_model
from worker.trainer.settings import TrainSettings
from worker.trainer.starting import file_digest, read_starting_model

log = logging.getLogger(__name__)


def check_page(page: Page, settings: TrainSettings) -> None:
    """Raise TrainingInputError for a page the settings cannot train on."""
    check_page_shape(page, settings)
    for label, mask in page.masks.items():
        if not np.any(mask):
            raise TrainingInputError(
                f"layer {label!r} has no pixels inside the selected regions; "
                "paint some of it there or leave the layer out"
            )


def page_name(pages: Sequence[Page], index: int) -> str:
    """``page 2`` or ``page 2 (name)``: how messages name a page of a multi-page run (1-based)."""
    name = pages[index].name
    return f"page {index + 1} ({name})" if name else f"page {index + 1}"


def check_pages(pages: Sequence[Page], settings: TrainSettings) -> None:
    """Raise TrainingInputError for pages the settings cannot train on together.

    One page: :func:`check_page`. Several: every page has the layers of the first, in the same
    order (the message names the page and both lists), passes :func:`check_page_shape`, and
    every layer has pixels inside the selected regions on at least one page (a page may lack
    a layer: it then gives that layer no samples).
    """
    if not pages:
        raise TrainingInputError("there are no pages to train on")
    if len(pages) == 1:
        check_page(pages[0], settings)
        return
    labels = list(pages[0].masks)
    for index, page in enumerate(pages):
        if list(page.masks) != labels:
            raise TrainingInputError(
                f"{page_name(pages, index)} has the layers {list(page.masks)}, {page_name(pages, 0)} has {labels}: "
                "every page must have the same layers in the same order"
            )
    for index, page in enumerate(pages):
        check_page_shape(page, settings, f"{page_name(pages, index)}: ")
    for label in labels:
        if not any(np.any(page.masks[label]) for page in pages):
            raise TrainingInputError(
                f"layer {label!r} has no pixels inside the selected regions on any of the {len(pages)} pages; "
                "paint some of it there or leave the layer out"
            )


def check_page_shape(page: Page, settings: TrainSettings, where: str = "") -> None:
    """Raise TrainingInputError for a page whose layers or size the settings cannot train on
    (everything :func:`check_page` checks except that every layer has pixels); the messages
    start with ``where`` (e.g. ``"page 2: "``)."""
    image = page.image
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"page.image must be uint8 (H, W, 3), not {image.dtype} {image.shape}")
    if not page.masks:
        raise TrainingInputError(f"{where}the page has no layers to train")
    height, width = page.height, page.width
    for label, mask in page.masks.items():
        if mask.ndim != 2:
            raise ValueError(f"the mask of layer {label!r} has shape {mask.shape}, not (height, width)")
        if mask.shape != (height, width):
            raise TrainingInputError(
                f"{where}layer {label!r} is {mask.shape[1]}x{mask.shape[0]} pixels but the image is {width}x{height}"
            )
    ph, pw = settings.patch_height, settings.patch_width
    if ph > height or pw > width:
        raise TrainingInputError(
            f"{where}the patch ({pw}x{ph} pixels) is larger than the page ({width}x{height}); "
            "choose a smaller patch width and height"
        )
    rows, cols = centre_ranges(height, width, ph, pw)
    if len(rows) == 0 or len(cols) == 0:
        raise TrainingInputError(
            f"{where}the page ({width}x{height} pixels) is too small for {pw}x{ph} patches: patches are "
            f"centred at least one patch width/height from the border, so the page must be at least "
            f"{2 * pw + 2}x{2 * ph + 2}; choose a smaller patch width and height"
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
    advice = (
        "Patches are centred on the layer's pixels away from the page border and on about one pixel "
        "in a hundred: paint more of the layer (and of every other layer, since all share the smallest "
        "layer's budget), raise the maximum number of samples per label, or choose a smaller patch size"
    )
    for label, found in centres.items():
        if len(found) < needed:
            raise TrainingInputError(
                f"only {len(found)} patches could be sampled for layer {label!r}, at least {needed} are "
                f"needed (some are held out for validation). {advice}"
            )
        train, validation = split_validation(found, settings.validation_split)
        if len(train) == 0 or len(validation) == 0:  # several pages: each holds out its own last part
            raise TrainingInputError(
                f"the {len(found)} patches sampled for layer {label!r} are spread too thinly over the pages "
                f"to hold some of every page's out for validation and train on the rest. {advice}"
            )


#: The settings that change what a run trains: a checkpoint is only resumed with the same.
#: (``strategy`` and ``mixed_precision`` say where it runs; see the module docstring.)
RUN_SETTINGS = (
    "epochs",
    "max_samples_per_label",
    "patch_height",
    "patch_width",
    "batch_size",
    "patience",
    "validation_split",
    "seed",
    "include_optimizer",
    "patch_anchor",
    "learning_rate",
    "patch_draws",
)
#: What a checkpoint written before a setting was in :data:`RUN_SETTINGS` trained with.
SETTINGS_BEFORE_RECORDED = {"patch_anchor": "centre", "learning_rate": 1e-4, "patch_draws": "once"}


def page_identity(page: Page) -> dict[str, Any]:
    """A page in a run's identity: its size, labels and a digest of its pixels and masks."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(page.image).tobytes())
    for label, mask in page.masks.items():
        digest.update(label.encode() + b"\0")
        digest.update(np.packbits(np.asarray(mask, dtype=bool)).tobytes())
    return {"height": page.height, "width": page.width, "labels": list(page.masks), "digest": digest.hexdigest()}


def run_identity(page: Page, settings: TrainSettings) -> dict[str, Any]:
    """What identifies a run in its checkpoints: the page (size, labels, a digest of its
    pixels and masks) and the :data:`RUN_SETTINGS`."""
    return {"page": page_identity(page), "settings": {name: getattr(settings, name) for name in RUN_SETTINGS}}


def pages_identity(
    pages: Sequence[Page], settings: TrainSettings, starting_models: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """What identifies a run of :func:`train_pages` in its checkpoints.

    One page without starting models: :func:`run_identity`, so that a one-page run's
    checkpoints are those :func:`train_page` always wrote. Several pages: ``"pages"``, every
    page's :func:`page_identity` in order. With starting models, ``"starting_models"``: label ->
    SHA-256 of the file.
    """
    if len(pages) == 1:
        run = run_identity(pages[0], settings)
    else:
        run = {
            "pages": [page_identity(page) for page in pages],
            "settings": {name: getattr(settings, name) for name in RUN_SETTINGS},
        }
    if starting_models:
        run["starting_models"] = dict(starting_models)
    return run


def _page_differences(old_page: Mapping[str, Any], new_page: Mapping[str, Any], which: str) -> list[str]:
    if (old_page.get("width"), old_page.get("height")) != (new_page["width"], new_page["height"]):
        return [
            f"{which} is {new_page['width']}x{new_page['height']} pixels, "
            f"the checkpoint's {old_page.get('width')}x{old_page.get('height')}"
        ]
    if old_page.get("labels") != new_page["labels"]:
        return [f"the layers are {new_page['labels']}, the checkpoint's {old_page.get('labels')}"]
    if old_page.get("digest") != new_page["digest"]:
        return [f"{which}'s image or layers differ from the checkpoint's"]
    return []


def check_same_run(saved: Mapping[str, Any], current: Mapping[str, Any], where: object) -> None:
    """Raise TrainingInputError, naming what differs, unless ``saved`` and ``current`` identify the same run."""
    differences = []
    old_pages = saved["pages"] if "pages" in saved else [saved.get("page", {})]
    new_pages = current["pages"] if "pages" in current else [current["page"]]
    several = len(new_pages) > 1
    if len(old_pages) != len(new_pages):
        differences.append(f"the run has {len(new_pages)} page(s), the checkpoint's {len(old_pages)}")
    else:
        for index, (old_page, new_page) in enumerate(zip(old_pages, new_pages, strict=True)):
            which = f"page {index + 1}" if several else "the page"
            differences.extend(_page_differences(old_page, new_page, which))
    old_settings = {**SETTINGS_BEFORE_RECORDED, **saved.get("settings", {})}
    for name, value in current["settings"].items():
        if old_settings.get(name) != value:
            differences.append(f"{name} is {value!r}, the checkpoint's {old_settings.get(name)!r}")
    old_models, new_models = saved.get("starting_models") or {}, current.get("starting_models") or {}
    if old_models != new_models:
        changed = sorted(k for k in {*old_models, *new_models} if old_models.get(k) != new_models.get(k))
        differences.append(f"the starting models of {', '.join(map(repr, changed))} differ from the checkpoint's")
    if differences:
        raise TrainingInputError(
            f"the checkpoints in {where} belong to another training run ({'; '.join(differences)}); "
            + (
                "they cannot be resumed with these pages and these settings: remove them or start a new run"
                if several
                else "they cannot be resumed with this page and these settings: remove them or start a new run"
            )
        )


def _assign(variables: Sequence[Any], values: Sequence[npt.NDArray[Any]]) -> None:
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def restore_optimizer(optimizer: Any, values: Sequence[npt.NDArray[Any]]) -> None:
    """Set a built optimizer's variables to ``values`` (``optimizer.variables`` when they were saved).

    When one side is a mixed-precision ``LossScaleOptimizer`` and the other not (a run resumed
    under another precision policy), only the wrapped Adam's variables, the tail of both
    lists, carry over.
    """
    variables = list(optimizer.variables)
    if len(variables) != len(values):
        log.warning("the optimizer had %d variables, now %d: restoring Adam's only", len(values), len(variables))
        count = min(len(variables), len(values))
        variables, values = variables[len(variables) - count :], values[len(values) - count :]
    _assign(variables, values)


class ModelReuse:
    """One compiled SAE per plan and patch size for a whole page, reset before each layer.

    Building and compiling a model takes a fraction of a second, but its first training step
    traces the train function (2-4 s on a CPU, an XLA compilation on a GPU) and its first
    validation the test function. Every layer of a page trains the same network on patches
    of the same size, so the later layers reuse the first one's model and traced functions:
    :meth:`model` sets its weights to those a new model would draw (a network built afresh
    right after the layer's seed was set, as for the first layer) and its optimizer's
    variables to their values when it was built, so a layer trains exactly as on a new model
    (``tests/test_resume.py`` gets bit-identical weights whichever layer a run resumes at).
    """

    def __init__(self) -> None:
        self._models: dict[tuple[Any, ...], tuple[Any, list[npt.NDArray[Any]]]] = {}

    def model(self, plan: TrainingPlan, height: int, width: int) -> Any:
        """A compiled model for ``plan`` in its initial state (weights drawn now, fresh optimizer)."""
        key = (id(plan.strategy), plan.policy, plan.replicas, plan.learning_rate, height, width)
        if key not in self._models:
            model = plan.build_model(height, width)
            with plan.strategy.scope():
                model.optimizer.build(model.trainable_variables)
            self._models[key] = (model, variable_values(model.optimizer.variables))
            return model
        model, optimizer_start = self._models[key]
        with dtype_policy(plan.policy):
            initial = build_sae(height, width).get_weights()  # the draws plan.build_model makes
        with plan.strategy.scope():
            model.set_weights(initial)
            _assign(model.optimizer.variables, optimizer_start)
        return model


def restore_model(model: Any, strategy: Any, state: LayerState) -> None:
    """Give a freshly built, compiled model a checkpoint's weights and optimizer state."""
    with strategy.scope():
        model.set_weights(state.weights)
        if not model.optimizer.built:  # Keras builds it at the first step: too late to restore it then
            model.optimizer.build(model.trainable_variables)
        restore_optimizer(model.optimizer, state.optimizer_variables)


class _AddMetricSums(keras.callbacks.Callback):  # type: ignore[misc]
    """Puts the running sums of the metrics at an interruption back into the resumed epoch's.

    They are sums (Keras' Mean: total and count), and float addition commutes, so the saved
    sums plus the first batch's equal, bit for bit, what the uninterrupted epoch had after
    that batch: the epoch's loss and accuracy cover the whole epoch. On TensorFlow, Keras
    builds the metrics at the first step, so the sums are added after it; on JAX the metrics
    are built before the epoch begins, and a variable written during the epoch would be
    overwritten by the step's own state (keras#19054), so the sums are set when the epoch
    begins, right after Keras reset the metrics to zero.
    """

    def __init__(self, sums: list[npt.NDArray[Any]]) -> None:
        super().__init__()
        self.sums: list[npt.NDArray[Any]] | None = sums

    def _add(self) -> None:
        if self.sums is None:
            return
        variables = [v for metric in self.model.metrics for v in metric.variables]
        for variable, value in zip(variables, self.sums, strict=True):
            variable.assign_add(value)
        self.sums = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if BACKEND == "jax":
            self._add()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._add()


class LayerLoop(keras.callbacks.Callback):  # type: ignore[misc]
    """Follows a layer's training: keeps its history, checkpoints every epoch end, stops on request.

    ``save`` (None: nothing is saved) receives the layer's :meth:`state` at every epoch end
    and when ``stop_requested`` stops training part-way; :meth:`save_now` saves at any batch
    boundary (``benchmarks/bench_checkpoint.py`` does, every few steps). Must come after
    every other callback of the trainer, so that an epoch end's checkpoint holds what they
    made of the epoch; :class:`EpochShuffle` must come before it.
    """

    def __init__(
        self,
        label: str,
        train_data: PatchDataset,
        epochs: int,
        best: BestEpoch,
        stopper: EarlyStopper,
        history: dict[str, list[float]],
        save: SaveLayer | None,
        stop_requested: Callable[[], bool] | None,
        fresh_starts: int = 0,
    ) -> None:
        super().__init__()
        self.label = label
        self.fresh_starts = fresh_starts
        self.data = train_data
        self.epochs = epochs
        self.best = best
        self.stopper = stopper
        self.history = history
        self.save = save
        self.stop_requested = stop_requested
        self.epoch = 0  # 0-based index of the epoch in progress
        self.samples_done = 0  # of that epoch, in the order self.order
        self.order: npt.NDArray[np.int64] | None = None
        self._epoch_start = 0  # samples_done when this fit's epoch began (a resumed epoch: not 0)
        self._continue: tuple[npt.NDArray[np.int64], int] | None = None

    @property
    def batches(self) -> int:
        return len(self.data)

    def continue_epoch(self, order: npt.NDArray[np.int64], samples_done: int) -> None:
        """The next fit's first epoch is the rest of one with ``order``, ``samples_done`` samples in."""
        self._continue = (order, samples_done)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch
        if self._continue is not None:
            (self.order, self.samples_done), self._continue = self._continue, None
        else:  # EpochShuffle, earlier in the list, has drawn this epoch's order
            self.order, self.samples_done = self.data.order, 0
        self._epoch_start = self.samples_done

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Before batch ``batch`` rather than after batch ``batch - 1``: Keras waits for a step's
        # results before every on_train_batch_end hook it calls (to hand them its logs), which
        # would keep the host from preparing the next batch while the GPU works on this one.
        if batch == 0:  # nothing of this fit is trained yet: the epoch end or the start checked
            return
        self.samples_done = self._epoch_start + batch * self.data.batch_size
        if self.stop_requested is None or not self.stop_requested():
            return
        path = self.save_now()
        done = math.ceil(self.samples_done / self.data.batch_size)
        log.info("layer %r: stopped in epoch %d after batch %d of %d", self.label, self.epoch + 1, done, self.batches)
        raise TrainingInterrupted(self.label, self.epoch + 1, done, self.batches, path)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))
        self.epoch, self.samples_done, self.order = epoch + 1, 0, None
        path = self.save_now()
        continues = not self.model.stop_training and epoch + 1 < self.epochs
        if continues and self.stop_requested is not None and self.stop_requested():
            log.info("layer %r: stopped after epoch %d", self.label, epoch + 1)
            raise TrainingInterrupted(self.label, epoch + 2, 0, self.batches, path)

    def save_now(self) -> Path | None:
        """Save the layer's state now (at a batch boundary); returns the checkpoint, None without ``save``."""
        return self.save(self.state()) if self.save is not None else None

    def state(self) -> LayerState:
        """The layer's state now (at a batch boundary)."""
        model = self.model
        rng = self.data.rng
        part_way = self.samples_done > 0
        return LayerState(
            label=self.label,
            epoch=self.epoch,
            sample_offset=self.samples_done,
            batch=math.ceil(self.samples_done / self.data.batch_size),
            batches=self.batches,
            batch_size=self.data.batch_size,
            weights=[np.array(w, copy=True) for w in model.get_weights()],
            optimizer_variables=variable_values(model.optimizer.variables),
            metric_variables=variable_values([v for m in model.metrics for v in m.variables]) if part_way else [],
            early_stopping=self.stopper.state(),
            best=self.best.state(),
            best_weights=self.best.weights,
            best_optimizer_variables=self.best.optimizer_variables,
            rng_state=dict(rng.bit_generator.state) if rng is not None else {},
            permutation=self.order if part_way else None,
            history={key: list(values) for key, values in self.history.items()},
            fresh_starts=self.fresh_starts,
        )


def train_label(
    page: Page | Sequence[Page],
    label: str,
    centres: Centres,
    settings: TrainSettings,
    *,
    shuffle_rng: np.random.Generator,
    init_seed: int | None = None,
    on_epoch: EpochCallback | None = None,
    callbacks: Sequence[Any] = (),
    resume: LayerState | None = None,
    save: SaveLayer | None = None,
    stop_requested: Callable[[], bool] | None = None,
    models: ModelReuse | None = None,
    bgr: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]] | None = None,
    initial_weights: Sequence[npt.NDArray[Any]] | None = None,
    on_layer: LayerCallback | None = None,
) -> LabelResult:
    """Train a fresh SAE (or one with ``initial_weights``) on ``label``'s samples and return its best epoch.

    ``page`` is one page, with ``(row, col)`` centres, or a sequence of pages, with
    ``(page, row, col)`` centres (see :func:`~worker.trainer.sampling.sample_pages_centres`);
    the split into training and validation samples is :func:`split_validation`'s (per page).

    The first ``1 - validation_split`` of ``centres`` train (in a new order every epoch,
    drawn from ``shuffle_rng``), the rest validate, ``settings.batch_size`` patches per step
    however many replicas share it (see :mod:`worker.trainer.distribute` for the strategy
    and the precision); at most ``settings.epochs`` epochs with early stopping on val_accuracy.
    ``init_seed`` seeds Keras (weight initialisation); ``callbacks`` are extra Keras
    callbacks, run after the trainer's own (their ``on_train_end`` is also called when
    training is interrupted, so that TensorBoard writes out what it has).

    ``resume`` continues from a checkpoint's state of this layer (``shuffle_rng`` must then
    be the generator in that state, see :func:`generator_from_state`). ``save`` is called
    with the layer's state at every epoch end and when ``stop_requested`` stops training
    (see the module docstring), which raises TrainingInterrupted. ``models`` lends a model
    already traced by an earlier layer (see :class:`ModelReuse`); without it one is built.
    ``bgr`` is the page in the network's channel order (:func:`network_order`), made once per
    page by :func:`train_pages` (a sequence with several pages); without it, it is made here.
    ``initial_weights`` (those of ``build_sae(...).get_weights()``, see
    :mod:`worker.trainer.starting`) replace the drawn weights before the first epoch; the
    optimizer starts fresh. A resumed layer continues from its checkpoint's weights instead.
    """
    train_centres, validation_centres = split_validation(centres, settings.validation_split)
    if len(train_centres) == 0 or len(validation_centres) == 0:
        check_samples({label: centres}, settings)
    # With patch_draws="every_epoch": about one draw's worth of patches validates and trains per epoch.
    draws = max(1, min(draw_factor(settings), round(len(centres) / settings.max_samples_per_label)))
    validation_centres = validation_centres[::draws]
    epoch_samples = max(1, len(train_centres) // draws) if draws > 1 else None
    ph, pw = settings.patch_height, settings.patch_width
    plan = plan_training(settings)  # the GPUs that share settings.batch_size evenly
    models = models or ModelReuse()
    pages = [page] if isinstance(page, Page) else list(page)
    images = [p.image for p in pages]
    masks = [np.asarray(p.masks[label], dtype=bool) for p in pages]
    batch = plan.global_batch_size
    replicas = plan.replicas  # every batch a multiple of this: an equal share per replica
    if bgr is None:
        bgr = [network_order(image) for image in images]
    anchor = settings.patch_anchor
    train_data = PatchDataset(
        images, masks, train_centres, ph, pw, batch, shuffle_rng=shuffle_rng, multiple_of=replicas, bgr=bgr,
        anchor=anchor, epoch_samples=epoch_samples,
    )  # fmt: skip
    validation_data = PatchDataset(
        images, masks, validation_centres, ph, pw, batch, multiple_of=replicas, weigh_for="accuracy", bgr=bgr,
        anchor=anchor,
    )  # fmt: skip
    layer_pixels, pixels = validation_data.layer_pixels()
    # Once: every fresh start trains on the same patches. An estimate over at most PRIOR_SAMPLES
    # patches: a pool of many epochs' draws would take seconds to count at 256 x 256.
    train_pixels = train_data.layer_pixels(most=PRIOR_SAMPLES)
    fresh_starts = resume.fresh_starts if resume is not None else 0
    while True:
        try:
            return _train_attempt(
                label, settings, plan, models, train_data, validation_data, train_pixels, (layer_pixels, pixels),
                seed=fresh_start_seed(init_seed, fresh_starts), fresh_starts=fresh_starts,
                on_epoch=on_epoch, callbacks=callbacks, resume=resume, save=save,
                stop_requested=stop_requested, initial_weights=initial_weights,
            )  # fmt: skip
        except FreshStart as restart:
            fresh_starts += 1
            resume = None  # the new start owes nothing to the checkpoint of the one it replaces
            log.warning(
                "layer %r: its first epoch ended no better than its starting answer (val_loss %.4f, the "
                "constant answer's %.4f; it marks %s): fresh start %d of %d from new weights",
                label, restart.loss, restart.start_loss, restart.answer, fresh_starts, settings.max_fresh_starts,
            )  # fmt: skip
            if on_layer is not None:
                on_layer(
                    {
                        "event": "fresh_start",
                        "label": label,
                        "answer": restart.answer,
                        "val_loss": restart.loss,
                        "start_loss": restart.start_loss,
                        "fresh_start": fresh_starts,
                        "of": settings.max_fresh_starts,
                    }
                )


def prior_bias(layer_pixels: int, pixels: int) -> float:
    """The output bias that makes a model whose hidden units are all zero answer the layer's share of
    the training targets: ``log(p / (1 - p))``, ``p`` kept within [1e-4, 1 - 1e-4].

    With the zero bias Keras draws, such a model answers 0.5 everywhere, and its gradient drives the
    units that feed the output to zero on the majority's pixels, after which only the bias moves
    (``tests/test_fresh_start.py``). Started at the layer's share, the majority's pixels are already
    nearly right, and what is left to learn is telling the pixels apart (RetinaNet's prior
    initialisation, Lin et al. 2017, section 3.3)."""
    share = min(max(layer_pixels / pixels, 1e-4), 1.0 - 1e-4) if pixels else 0.5
    return math.log(share / (1.0 - share))


def start_output(model: Any, plan: TrainingPlan, how: str, layer_pixels: int, pixels: int) -> None:
    """Set a new model's output layer (the 1x1 convolution named ``probability``) as ``how`` says
    (:data:`~worker.trainer.settings.OUTPUT_START_CHOICES`): ``"keras"`` leaves Keras' draw (a zero
    bias); ``"prior"`` sets the bias to :func:`prior_bias`; ``"opposed"`` also gives its two weights,
    as drawn in size, opposite signs: the first positive, the second negative.

    The output reads two ReLU units. Drawn with the same sign (half of Keras' draws), both can only
    push the probability one way from the bias, and on the staff lines they often both learned to fire
    on the other pixels and pull those down: the layer's pixels then sit at the bias's probability,
    below 0.5, and Adam at 1e-4 moves the bias by 1e-4 a step, so the model marks nothing for its
    whole run (``tests/test_fresh_start.py``; 4 of 7 staff-line models on ``bench_paco.py``'s crop pair
    32r at 10 epochs). With opposite signs one unit answers for the layer and one for the rest from
    the first step."""
    if how == "keras":
        return
    layer = model.get_layer("probability")
    kernel, bias = layer.get_weights()
    bias = np.full_like(bias, prior_bias(layer_pixels, pixels))
    if how == "opposed":
        kernel = np.abs(kernel)
        kernel[..., 1:, :] *= -1  # kernel (1, 1, units, 1): the units after the first pull down
    with plan.strategy.scope():
        layer.set_weights([kernel, bias])


def fresh_start_seed(init_seed: int | None, fresh_starts: int) -> int | None:
    """The seed of a layer's weights: ``init_seed`` at first, a new one derived from it at each fresh start."""
    if init_seed is None or fresh_starts == 0:
        return init_seed
    return int(np.random.SeedSequence([init_seed, fresh_starts]).generate_state(1)[0])


def _train_attempt(
    label: str,
    settings: TrainSettings,
    plan: TrainingPlan,
    models: ModelReuse,
    train_data: PatchDataset,
    validation_data: PatchDataset,
    train_pixels: tuple[int, int],
    validation_pixels: tuple[int, int],
    *,
    seed: int | None,
    fresh_starts: int,
    on_epoch: EpochCallback | None,
    callbacks: Sequence[Any],
    resume: LayerState | None,
    save: SaveLayer | None,
    stop_requested: Callable[[], bool] | None,
    initial_weights: Sequence[npt.NDArray[Any]] | None,
) -> LabelResult:
    """One start of :func:`train_label`'s layer from the weights ``seed`` draws (or ``initial_weights``);
    raises FreshStart when its first epoch ends in one class and a fresh start is left."""
    ph, pw = settings.patch_height, settings.patch_width
    train_samples, validation_samples = train_data.samples, validation_data.samples
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = models.model(plan, ph, pw)  # made inside plan.strategy.scope()
    if initial_weights is not None:
        with plan.strategy.scope():
            model.set_weights(list(initial_weights))
    train_layer_pixels, train_all = train_pixels
    start_probability = 0.5  # a zero output bias: sigmoid(0)
    if settings.output_start != "keras":
        start_probability = min(max(train_layer_pixels / train_all, 1e-4), 1.0 - 1e-4)
    if initial_weights is None and resume is None:
        start_output(model, plan, settings.output_start, train_layer_pixels, train_all)
    layer_pixels, pixels = validation_pixels
    best = BestEpoch(
        keep_optimizer=settings.include_optimizer, trivial=lambda v, share: one_class(v, layer_pixels, pixels, share)
    )
    stopper = EarlyStopper(settings.patience)
    history: dict[str, list[float]] = {}
    loop = LayerLoop(label, train_data, settings.epochs, best, stopper, history, save, stop_requested, fresh_starts)
    # A starting model the user gave is never replaced; nor is a layer resumed past its first epoch.
    guard = FirstEpochGuard(
        label,
        layer_pixels,
        pixels,
        start_probability,
        enabled=(
            fresh_starts < settings.max_fresh_starts
            and initial_weights is None
            and (resume is None or resume.epoch == 0)
        ),
    )
    first_epoch, rest_of_epoch = 0, None
    if resume is not None:
        best.restore(resume.best, resume.best_weights, resume.best_optimizer_variables)
        stopper.restore(resume.early_stopping)
        history.update({key: list(values) for key, values in resume.history.items()})
        first_epoch = resume.epoch
        if resume.sample_offset and resume.permutation is not None:
            rest_of_epoch = train_data.remaining(resume.permutation, resume.sample_offset)
            loop.continue_epoch(resume.permutation, resume.sample_offset)
        log.info(
            "layer %r: resuming in epoch %d after %d of its %d training patches",
            label, first_epoch + 1, resume.sample_offset, train_samples,
        )  # fmt: skip

    validation_input = training_input(validation_data)

    def fit(data: Any, start: int, stop: int, samples: int, own: list[Any]) -> None:
        reporter = EpochReporter(label, samples, on_epoch)
        with plan.training():
            model.fit(
                training_input(data),
                validation_data=validation_input,
                initial_epoch=start,
                epochs=stop,
                shuffle=False,  # the dataset shuffles itself (EpochShuffle): Keras would reorder its batches
                callbacks=[guard, *own, best, stopper, reporter, *callbacks, loop],
                verbose=0,
            )

    left = rest_of_epoch is not None or (first_epoch < settings.epochs and not stopper.stopped)
    if left and stop_requested is not None and stop_requested():  # the latest checkpoint is where we are
        batch_done = resume.batch if resume is not None else 0
        path = None
        if resume is None and fresh_starts > 0:
            # Except after a fresh start: the latest checkpoint is the rejected start's, and a job that
            # resumed it would repeat the rejected epoch, be stopped here again, and never get further.
            loop.set_model(model)
            path = loop.save_now()
        raise TrainingInterrupted(label, first_epoch + 1, batch_done, len(train_data), path)
    log.info("layer %r: training on %d patches, validating on %d", label, train_samples, validation_samples)
    if resume is not None:
        restore_model(model, plan.strategy, resume)
    try:
        if rest_of_epoch is not None and resume is not None:
            sums = [_AddMetricSums(resume.metric_variables)] if resume.metric_variables else []
            fit(rest_of_epoch, first_epoch, first_epoch + 1, rest_of_epoch.samples, sums)
            first_epoch += 1
        if first_epoch < settings.epochs and not stopper.stopped:
            fit(train_data, first_epoch, settings.epochs, train_samples, [EpochShuffle(train_data.shuffle)])
    except (TrainingInterrupted, FreshStart):
        for callback in callbacks:  # e.g. TensorBoard: close its writers, so that its files are complete
            callback.on_train_end()
        raise
    weights, optimizer_variables = best.weights, trained_optimizer_variables(model, best.optimizer_variables)
    if weights is None:  # no epoch reported val_accuracy: keep what training ended with
        weights = model.get_weights()
        if settings.include_optimizer:
            optimizer_variables = trained_optimizer_variables(model, variable_values(model.optimizer.variables))
    return LabelResult(
        label=label,
        weights=weights,
        optimizer_variables=optimizer_variables,
        best_epoch=best.best_epoch,
        best_val_accuracy=best.best,
        one_class=one_class(best.best, layer_pixels, pixels, best.best_share) if best.weights is not None else None,
        fresh_starts=fresh_starts,
        epochs_run=len(history.get("loss", [])),
        train_samples=train_samples,
        validation_samples=validation_samples,
        history=history,
    )


def train_page(
    page: Page,
    settings: TrainSettings,
    out_dir: Path,
    on_epoch: EpochCallback | None = None,
    run_dir: RunDirectory | None = None,
    *,
    checkpoints: CheckpointStore | None = None,
    stop_requested: Callable[[], bool] | None = None,
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
    kept there too, and after each layer (and when training is interrupted) its history
    files and curves are rewritten.

    With ``checkpoints`` the run is checkpointed and resumed (see the module docstring):
    if the store holds a checkpoint, it must be of this page and these settings
    (TrainingInputError otherwise), and the run continues from it; the epoch records
    before it are put back into ``run_dir`` (``on_epoch`` only hears of the epochs trained
    in this call). Without ``settings.seed`` a seed is drawn at the first start and kept in
    the checkpoints. ``stop_requested`` (any callable, polled between batches; a signal
    handler should only set the flag it reads) makes training save a checkpoint and raise
    TrainingInterrupted; without ``checkpoints`` it still stops, but nothing is saved.

    This is :func:`train_pages` with one page and no starting models.
    """
    return train_pages(
        [page], settings, out_dir, on_epoch, run_dir, checkpoints=checkpoints, stop_requested=stop_requested
    )


def train_pages(
    pages: Sequence[Page],
    settings: TrainSettings,
    out_dir: Path,
    on_epoch: EpochCallback | None = None,
    run_dir: RunDirectory | None = None,
    *,
    checkpoints: CheckpointStore | None = None,
    stop_requested: Callable[[], bool] | None = None,
    initial_models: Mapping[str, Path] | None = None,
    on_layer: LayerCallback | None = None,
) -> dict[str, Path]:
    """Train one model per layer over all ``pages`` at once (in the first page's ``masks`` order) into ``out_dir``.

    Every page must have the same labels in the same order (TrainingInputError naming the page
    and both lists otherwise). Each layer's samples are drawn across all pages (see
    :func:`~worker.trainer.sampling.sample_pages_centres`: the per-label cap applies to the
    total, allotted to the pages in proportion to the layer's pixels on each), every page holds
    out the last part of its own samples for validation (:func:`split_validation`), and one
    model per layer trains on all of them; everything else is :func:`train_page`'s (whose
    docstring this extends): the files, the run directory, the checkpoints, ``stop_requested``.
    With one page the samples, the weights and the files are exactly :func:`train_page`'s.

    ``initial_models`` maps labels to starting models (Keras HDF5 files): those layers start
    from the file's weights instead of fresh ones (see :mod:`worker.trainer.starting`: the
    architecture is checked against the SAE, layers are matched by order, any optimizer state
    in the file is ignored). Every file is read and checked before anything trains; a label
    that is not a layer of the pages raises TrainingInputError. The files' SHA-256 are part of
    the run's identity in its checkpoints: a run resumes only with the same starting models.

    **Models that cannot move.** A layer whose first epoch ends with its model marking every
    validation pixel alike (all background, or all layer) starts again from new weights, at most
    ``settings.max_fresh_starts`` times (:class:`~worker.trainer.callbacks.FirstEpochGuard`; not a layer
    given a starting model). ``on_layer`` (any callable) hears of each such fresh start
    (``{"event": "fresh_start", "label", "answer", "loss", "fresh_start", "of"}``) and of every layer
    trained in this call (``{"event": "layer_trained", "label", "best_epoch", "best_val_accuracy",
    "epochs_run", "fresh_starts", "one_class"}``), where ``one_class`` is None or what the kept model
    answers for every pixel (:func:`~worker.trainer.callbacks.one_class`): a layer that learned
    nothing, which is logged as a warning and must be reported as one.
    """
    pages = list(pages)
    outputs: RunOutputs = run_dir if run_dir is not None else NoRunDirectory()
    outputs.write_settings(dataclasses.asdict(settings))  # first: a run that fails on its input says how it was set
    check_pages(pages, settings)
    labels = list(pages[0].masks)
    starting, digests = read_starting_models(initial_models or {}, labels, settings)
    precision = resolve_precision(settings.mixed_precision)  # "auto": what this node's GPUs do well
    journal = open_journal(pages, settings, checkpoints, digests, {"backend": BACKEND, "mixed_precision": precision})
    settings = dataclasses.replace(settings, mixed_precision=journal.trained_on["mixed_precision"])
    check_samples(journal.centres, settings)
    outputs.reserve_tensorboard_names(labels)  # the same directory per label whichever layer a run starts at
    journal.restore_records(outputs)
    record = journal.recording(outputs.epoch_callback(on_epoch))
    journal.begin()

    names = model_file_names(labels)
    models = ModelReuse()
    bgr = [network_order(page.image) for page in pages]  # once for every layer's datasets
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    try:
        for label, (shuffle_seed, init_seed) in zip(labels, layer_seeds(journal.seed, len(labels)), strict=True):
            target = out_dir / names[label]
            if journal.is_finished(label):
                paths[label], done = journal.restore_finished(label, target)
                log.info(
                    "layer %r: trained before (best val_accuracy %.4f at epoch %d of %d), model from %s",
                    label, done.best_val_accuracy, done.best_epoch, done.epochs_run, journal.where,
                )  # fmt: skip
                continue
            result = train_label(
                pages[0] if len(pages) == 1 else pages,
                label,
                journal.centres[label],
                settings,
                shuffle_rng=journal.shuffle_rng(label, shuffle_seed),
                init_seed=init_seed,
                on_epoch=record,
                callbacks=outputs.keras_callbacks(label),
                resume=journal.resume(label),
                save=journal.save,
                stop_requested=stop_requested,
                models=models,
                bgr=bgr[0] if len(pages) == 1 else bgr,
                initial_weights=starting.get(label),
                on_layer=on_layer,
            )
            paths[label] = save_model(result, target, settings)
            journal.layer_finished(result, paths[label])
            log.info(
                "layer %r: best val_accuracy %.4f at epoch %d of %d, saved to %s",
                label, result.best_val_accuracy, result.best_epoch, result.epochs_run, paths[label],
            )  # fmt: skip
            if result.one_class is not None:
                log.warning("layer %r: its model marks %s on the validation patches", label, result.one_class)
            if on_layer is not None:
                on_layer(
                    {
                        "event": "layer_trained",
                        "label": label,
                        "best_epoch": result.best_epoch,
                        "best_val_accuracy": result.best_val_accuracy,
                        "epochs_run": result.epochs_run,
                        "fresh_starts": result.fresh_starts,
                        "one_class": result.one_class,
                    }
                )
            outputs.write_artifacts()
    except TrainingInterrupted:
        outputs.write_artifacts()
        raise
    return paths


def read_starting_models(
    initial_models: Mapping[str, Path], labels: Sequence[str], settings: TrainSettings
) -> tuple[dict[str, list[npt.NDArray[np.float32]]], dict[str, str]]:
    """Every starting model's weights (checked, see :mod:`worker.trainer.starting`) and SHA-256, by label."""
    unknown = [label for label in initial_models if label not in labels]
    if unknown:
        raise TrainingInputError(
            f"starting models were given for {', '.join(map(repr, unknown))}, which the pages have no layer of "
            f"(their layers: {list(labels)})"
        )
    weights: dict[str, list[npt.NDArray[np.float32]]] = {}
    digests: dict[str, str] = {}
    for label in labels:  # in training order, so that the first bad file is the one reported
        if label not in initial_models:
            continue
        path = Path(initial_models[label])
        name = f"the starting model of layer {label!r} ({path.name})"
        weights[label] = read_starting_model(path, name, settings.patch_height, settings.patch_width)
        digests[label] = file_digest(path)
        log.info("layer %r: starts from the weights of %s", label, path.name)
    return weights, digests


def open_journal(
    pages: Sequence[Page],
    settings: TrainSettings,
    checkpoints: CheckpointStore | None,
    starting_models: Mapping[str, str] | None = None,
    trained_on: Mapping[str, str] | None = None,
) -> Journal:
    """The run's journal: resumed from the latest checkpoint in ``checkpoints`` (which must be
    of these pages, these settings and these starting models' digests), else a new run's (its
    seed drawn if not set, its samples drawn); without ``checkpoints``, one that saves nothing.

    ``trained_on`` (default: this process's Keras backend and ``settings.mixed_precision``) is
    kept in the checkpoints: a run resumes only on the backend it started on
    (TrainingInputError naming both otherwise), and keeps the precision it started with
    (``journal.trained_on``), whatever ``settings`` now say.
    """
    trained_on = dict(trained_on or {"backend": BACKEND, "mixed_precision": settings.mixed_precision})
    journal: Journal
    if checkpoints is None:
        journal = NoCheckpoints(settings.seed, _sample(pages, settings, settings.seed))
    elif (state := checkpoints.load_latest()) is None:
        run = pages_identity(pages, settings, starting_models) | {"trained_on": trained_on}
        # kept in the checkpoints, so that a resumed run continues with it
        seed = settings.seed if settings.seed is not None else secrets.randbits(63)
        journal = CheckpointJournal(checkpoints, run, seed, _sample(pages, settings, seed), None)
    else:
        run = pages_identity(pages, settings, starting_models)
        check_same_run(state.run, run, checkpoints.directory)
        trained_on = run["trained_on"] = kept_trained_on(state.run, trained_on, checkpoints.directory)
        log.info(
            "resuming from checkpoint %d: %d of %d layers finished",
            state.sequence, len(state.finished), len(pages[0].masks),
        )  # fmt: skip
        journal = CheckpointJournal(checkpoints, run, state.seed, state.centres, state)
    journal.trained_on = trained_on
    return journal


def kept_trained_on(saved_run: Mapping[str, Any], now: Mapping[str, str], where: object) -> dict[str, str]:
    """What a resumed run trains on: its checkpoints' backend, which must be this process's, and precision.

    Checkpoints written before they recorded it are TensorFlow's, in the precision now asked for.
    """
    saved = dict(saved_run.get("trained_on") or {"backend": "tensorflow"})
    if saved["backend"] != now["backend"]:
        raise TrainingInputError(
            f"the checkpoints in {where} were written on Keras' {saved['backend']} backend and this worker runs "
            f"{now['backend']}: a run continues on the backend it started on. Run its continuation in a worker "
            f"environment with KERAS_BACKEND={saved['backend']} (e.g. in HPC_JOB_PROLOGUE), or start a new run"
        )
    precision = saved.get("mixed_precision", now["mixed_precision"])
    if precision != now["mixed_precision"]:
        log.warning(
            "the run started with mixed_precision %r and continues with it (%r was asked for)",
            precision, now["mixed_precision"],
        )  # fmt: skip
    return {"backend": saved["backend"], "mixed_precision": precision}


#: The most training patches whose pixels the layer's share (the output's prior) is counted over.
PRIOR_SAMPLES = 4096


def draw_factor(settings: TrainSettings) -> int:
    """How many epochs' worth of patches a layer's centres hold: 1 with ``patch_draws="once"``,
    ``epochs`` with ``"every_epoch"``.

    With ``"every_epoch"`` the sampler draws ``epochs`` times the samples per label at once (the
    original's random walk with a cap that many times larger, so the centres spread over the whole
    selection as before); :func:`train_label` validates on every ``epochs``-th of the held-out part
    and trains each epoch on as many of the rest as one draw would give, chosen anew every epoch
    (:class:`~worker.trainer.dataset.PatchDataset`'s ``epoch_samples``). Over a run the model sees
    up to ``epochs`` times as many different patches, as Paco_classifier's generator gives it, for
    the same steps."""
    return settings.epochs if settings.patch_draws == "every_epoch" else 1


def _sample(pages: Sequence[Page], settings: TrainSettings, seed: int | None) -> dict[str, Centres]:
    ph, pw = settings.patch_height, settings.patch_width
    cap = settings.max_samples_per_label * draw_factor(settings)
    if len(pages) == 1:
        return run_centres(pages[0].masks, ph, pw, cap, seed)
    return run_pages_centres([page.masks for page in pages], ph, pw, cap, seed)


def layer_seeds(seed: int | None, layers: int) -> list[tuple[np.random.SeedSequence, int | None]]:
    """Per layer, what seeds its shuffling generator and Keras (for Keras: None without ``seed``)."""
    _, *per_layer = np.random.SeedSequence(seed).spawn(1 + layers)
    seeds = []
    for layer_seed in per_layer:
        shuffle_seed, init_seed = layer_seed.spawn(2)
        seeds.append((shuffle_seed, None if seed is None else int(init_seed.generate_state(1)[0])))
    return seeds
