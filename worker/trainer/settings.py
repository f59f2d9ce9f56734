"""Training settings: what the trainer is told, and its own defaults (none of Rodan's)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.trainer.errors import TrainingInputError

#: The network pools twice by 2 and concatenates the up-sampled maps with the earlier
#: ones, so a patch side must be a multiple of 4 or the shapes do not line up.
PATCH_MULTIPLE = 4
#: Values of ``TrainSettings.strategy`` besides a tuple of device names.
STRATEGY_CHOICES = ("auto", "mirrored", "default")
#: Values of ``TrainSettings.patch_anchor`` (see :func:`worker.trainer.dataset.anchor_offset`).
PATCH_ANCHOR_CHOICES = ("centre", "corner")
#: Values of ``TrainSettings.patch_draws`` (see :func:`worker.trainer.train.draw_factor`).
PATCH_DRAWS_CHOICES = ("once", "every_epoch")
#: Values of ``TrainSettings.output_start`` (see :func:`worker.trainer.train.start_output`).
OUTPUT_START_CHOICES = ("keras", "prior", "opposed")
#: Values of ``TrainSettings.mixed_precision``.
MIXED_PRECISION_CHOICES = ("off", "auto", "float16", "bfloat16")
#: How many times a layer whose first epoch ends in one class starts again from new weights
#: (:class:`~worker.trainer.callbacks.FirstEpochGuard`); after that its model is kept and reported.
MAX_FRESH_STARTS = 2


@dataclass(frozen=True)
class TrainSettings:
    """How to train one page.

    The first six are the request's, always given (the worker takes them from the parameter
    file; the defaults are Rodan's, applied by the bridge): ``epochs`` is Rodan's "Maximum
    number of training epochs" (early stopping may end sooner), ``max_samples_per_label`` its
    "Maximum number of samples per label", and so on. The rest default to the trainer's own
    choices: ``include_optimizer`` keeps the Adam state in the saved files (three times larger;
    Rodan only infers, so it is off by default).

    ``batch_size`` is the patches of one training step, however many replicas (GPUs)
    share it: with ``n`` replicas each computes ``batch_size / n`` of them, so adding GPUs
    does not change what is trained. ``strategy`` chooses the ``tf.distribute`` strategy:
    ``"auto"`` (MirroredStrategy over the GPUs when more than one is visible, else the
    default strategy), ``"mirrored"``, ``"default"``, or a tuple of device names for
    ``MirroredStrategy(devices=...)`` (a list is turned into a tuple). ``mixed_precision``
    is ``"auto"`` (bfloat16 on GPUs of compute capability 8.0 and up, float32 elsewhere; the
    default), ``"off"`` (float32, the original trainer's precision, on every device),
    ``"float16"`` (``mixed_float16``) or ``"bfloat16"`` (``mixed_bfloat16``). See
    :mod:`worker.trainer.distribute`. ``output_start`` is how a new model's output layer starts
    (:func:`worker.trainer.train.start_output`): ``"keras"`` as Keras draws it (the original
    trainer's), ``"prior"`` its bias at the layer's log-odds, ``"opposed"`` (the default) that bias
    and its two weights of opposite signs. ``patch_draws`` is ``"every_epoch"`` (the default, as
    Paco_classifier's generator: each epoch trains on a new draw of as many patches;
    :func:`worker.trainer.train.draw_factor`) or ``"once"`` (the original HPC trainer's: every epoch
    trains on the same patches). ``max_fresh_starts`` is how many times a layer whose first epoch
    ends where it started begins again from new weights (:data:`MAX_FRESH_STARTS`).
    """

    epochs: int
    max_samples_per_label: int
    patch_height: int
    patch_width: int
    batch_size: int
    patience: int
    validation_split: float = 0.2
    seed: int | None = None
    include_optimizer: bool = False
    strategy: str | tuple[str, ...] = "auto"
    mixed_precision: str = "auto"
    patch_anchor: str = "centre"
    learning_rate: float = 1e-4
    output_start: str = "opposed"
    patch_draws: str = "every_epoch"
    max_fresh_starts: int = MAX_FRESH_STARTS

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise TrainingInputError(f"the number of training epochs must be at least 1, not {self.epochs}")
        if self.max_samples_per_label < 1:
            raise TrainingInputError(
                f"the maximum number of samples per label must be at least 1, not {self.max_samples_per_label}"
            )
        for name, value in (("height", self.patch_height), ("width", self.patch_width)):
            if value < PATCH_MULTIPLE or value % PATCH_MULTIPLE:
                raise TrainingInputError(
                    f"the patch {name} must be a positive multiple of {PATCH_MULTIPLE}, not {value}"
                )
        if self.batch_size < 1:
            raise TrainingInputError(f"the batch size must be at least 1, not {self.batch_size}")
        if self.patience < 0:
            raise TrainingInputError(f"the early-stopping patience cannot be negative ({self.patience})")
        if not 0.0 < self.validation_split < 1.0:
            raise TrainingInputError(
                f"the validation split must lie strictly between 0 and 1, not {self.validation_split}"
            )
        if self.seed is not None and self.seed < 0:
            raise TrainingInputError(f"the seed must be a non-negative integer, not {self.seed}")
        if isinstance(self.strategy, str):
            if self.strategy not in STRATEGY_CHOICES:
                raise TrainingInputError(
                    f"the strategy must be one of {', '.join(STRATEGY_CHOICES)} or a list of devices, "
                    f"not {self.strategy!r}"
                )
        else:
            devices = tuple(self.strategy)
            if not devices or not all(isinstance(d, str) and d for d in devices):
                raise TrainingInputError(f"the strategy's devices must be non-empty names, not {self.strategy!r}")
            object.__setattr__(self, "strategy", devices)  # frozen: a list would not hash
        if self.patch_anchor not in PATCH_ANCHOR_CHOICES:
            raise TrainingInputError(
                f"patch_anchor must be one of {', '.join(PATCH_ANCHOR_CHOICES)}, not {self.patch_anchor!r}"
            )
        if self.patch_draws not in PATCH_DRAWS_CHOICES:
            raise TrainingInputError(
                f"patch_draws must be one of {', '.join(PATCH_DRAWS_CHOICES)}, not {self.patch_draws!r}"
            )
        if self.output_start not in OUTPUT_START_CHOICES:
            raise TrainingInputError(
                f"output_start must be one of {', '.join(OUTPUT_START_CHOICES)}, not {self.output_start!r}"
            )
        if self.max_fresh_starts < 0:
            raise TrainingInputError(f"max_fresh_starts cannot be negative ({self.max_fresh_starts})")
        if not 0.0 < self.learning_rate < 1.0:
            raise TrainingInputError(f"the learning rate must lie strictly between 0 and 1, not {self.learning_rate}")
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise TrainingInputError(
                f"mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, not {self.mixed_precision!r}"
            )
