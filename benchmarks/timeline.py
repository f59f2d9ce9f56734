"""The observing Keras callback every trainer of the benchmarks trains with: ours in .venv's Keras 3
(``bench_trainer.py``, ``bench_paco.py``), Paco's in TensorFlow 2.15.1's tf.keras (``paco_side.py``)
and the original trainer's in Keras 2.3.1 on Python 3.7 (``original_stack/original_trainer.py``).
It notes when training, epochs, training batches and validations begin and end, and each epoch's
logs. Standard library only, and Python 3.7 syntax, so that every one of those environments imports
it; the caller passes its own ``Callback`` base class."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timeline_class(base: type) -> type:
    """A ``base`` subclass ``Timeline(events, history=None, on_train_begin=None)``.

    Its instances append ``[event, index, time.time()]`` to ``events``, the events being
    ``train_begin``, ``train_end``, ``epoch_begin``, ``epoch_end``, ``batch_begin`` and
    ``batch_end`` (training batches), ``test_begin`` and ``test_end`` (validation), the index the
    epoch's or the batch's (None for the others). Given ``history``, each epoch's logs (as floats)
    are appended to it; given ``on_train_begin``, it is called with the model whenever a fit begins
    (``bench_trainer.py`` keeps the weights a layer starts from).
    """

    class Timeline(base):  # type: ignore[misc]
        def __init__(
            self,
            events: list[Any],
            history: list[dict[str, float]] | None = None,
            on_train_begin: Callable[[Any], None] | None = None,
        ) -> None:
            super().__init__()
            self.events, self.history, self.train_begins = events, history, on_train_begin

        def _add(self, what: str, index: int | None = None) -> None:
            self.events.append([what, index, time.time()])

        def on_train_begin(self, logs: Any = None) -> None:
            self._add("train_begin")
            if self.train_begins is not None:
                self.train_begins(self.model)

        def on_train_end(self, logs: Any = None) -> None:
            self._add("train_end")

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._add("epoch_begin", epoch)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._add("epoch_end", epoch)
            if self.history is not None:
                self.history.append({k: float(v) for k, v in (logs or {}).items()})

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._add("batch_begin", batch)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._add("batch_end", batch)

        def on_test_begin(self, logs: Any = None) -> None:
            self._add("test_begin")

        def on_test_end(self, logs: Any = None) -> None:
            self._add("test_end")

    return Timeline
