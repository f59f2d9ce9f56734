"""The observing Keras callback both sides of bench_paco.py train with (ours in .venv's Keras 3,
Paco's in TensorFlow 2.15.1's tf.keras): it notes when training, epochs and steps end, and each
epoch's logs. Standard library only, so that either environment imports it; the caller passes its
own ``Callback`` base class."""

from __future__ import annotations

import time
from typing import Any


def timeline_class(base: type) -> type:
    """A ``base`` subclass whose instances append ``[event, index, time.time()]`` to ``events``
    and, when given ``history``, each epoch's logs (as floats) to it."""

    class Timeline(base):  # type: ignore[misc,valid-type]
        def __init__(self, events: list[Any], history: list[dict[str, float]] | None = None) -> None:
            super().__init__()
            self.events, self.history = events, history

        def on_train_begin(self, logs: Any = None) -> None:
            self.events.append(["train_begin", None, time.time()])

        def on_train_end(self, logs: Any = None) -> None:
            self.events.append(["train_end", None, time.time()])

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.events.append(["epoch_begin", epoch, time.time()])

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.events.append(["batch_end", batch, time.time()])

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.events.append(["epoch_end", epoch, time.time()])
            if self.history is not None:
                self.history.append({k: float(v) for k, v in (logs or {}).items()})

    return Timeline
