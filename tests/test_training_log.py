"""The Log File (worker/training_log.py): one story over every job of a request."""

from __future__ import annotations

import math
from pathlib import Path

from worker.training_log import LOG_NAME, TrainingLog, best_epoch, format_seconds


class Clock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def record(label: str, epoch: int, val_accuracy: float, loss: float = 0.5) -> dict[str, object]:
    return {
        "label": label,
        "epoch": epoch,
        "loss": loss,
        "accuracy": 0.8,
        "val_loss": 0.4,
        "val_accuracy": val_accuracy,
        "seconds": 12.5,
        "samples_per_second": 40.0,
    }


def test_format_seconds() -> None:
    assert format_seconds(12.34) == "12.3 s"
    assert format_seconds(125) == "2 min 5 s"
    assert format_seconds(3725) == "1 h 2 min"
    assert format_seconds(math.nan) == "?"


def test_best_epoch_is_the_first_highest_val_accuracy() -> None:
    records = [record("B", 1, 0.7), record("B", 2, 0.9), record("B", 3, 0.9), record("B", 4, math.nan)]
    best = best_epoch(records)
    assert best is not None and best["epoch"] == 2
    assert best_epoch([record("B", 1, math.nan)]) is None


def test_one_job_tells_pages_settings_epochs_best_and_time(tmp_path: Path) -> None:
    clock = Clock()
    story = TrainingLog.open(tmp_path, clock=clock)
    story.job_started(
        request="req-1",
        job="61",
        host="node7",
        continuation=0,
        settings={"Batch Size": 8, "Patience": 15},
    )
    story.inputs(["Sample 1 (320x384)", "Sample 2 (320x384)"], ["Background Model"])
    for epoch, accuracy in enumerate([0.6, 0.8, 0.7], start=1):
        clock.now += 10
        story.epoch(record("Background", epoch, accuracy))
    story.epoch(record("Layer 1", 1, 0.55))
    clock.now += 3600
    story.finished(["Background Model", "Model 1"])
    text = (tmp_path / LOG_NAME).read_text()
    assert text == story.text()
    lines = text.splitlines()
    assert lines[0] == "HPC training of request req-1"
    assert "job 61 on node7: started" in text
    assert "pages (2): Sample 1 (320x384); Sample 2 (320x384)" in text
    assert "settings: Batch Size = 8, Patience = 15" in text
    assert "training starts from: Background Model" in text
    epoch_2 = "  epoch 2: loss 0.5000, accuracy 0.8000, val_loss 0.4000, val_accuracy 0.8000 (12.5 s, 40.0 samples/s)"
    assert epoch_2 in lines
    assert "  layer Background: best val_accuracy 0.8000 at epoch 2 of 3 run; its model is the one returned" in lines
    assert "  layer Layer 1: best val_accuracy 0.5500 at epoch 1 of 1 run; its model is the one returned" in lines
    assert lines[-1].endswith("finished: 2 models (Background Model, Model 1) in 1 h 0 min over 1 job")


def test_a_continued_training_is_one_story(tmp_path: Path) -> None:
    clock = Clock()
    first = TrainingLog.open(tmp_path, clock=clock)
    first.job_started(request="req-2", job="70", host="n1", continuation=0)
    first.inputs(["Sample 1 (64x64)"])
    first.epoch(record("Background", 1, 0.6))
    first.epoch(record("Background", 2, 0.9))
    clock.now += 600
    first.stopped(where="layer 'Background' epoch 3 batch 2 of 5", reason="the time-limit warning")

    # The next job is another process: it finds the story so far on disk.
    clock.now += 60
    second = TrainingLog.open(tmp_path, clock=clock)
    second.job_started(request="req-2", job="71", host="n2", continuation=1)
    second.inputs(["Sample 1 (64x64)"])  # not told again
    second.epoch(record("Background", 2, 0.85))  # the epoch whose checkpoint was lost, trained again
    second.epoch(record("Background", 3, 0.7))
    clock.now += 600
    second.finished(["Background Model"])
    text = second.text()
    lines = text.splitlines()
    assert text.count("HPC training of request req-2") == 1
    assert text.count("pages (1): Sample 1 (64x64)") == 1
    assert "job 70 on n1: started" in text
    assert "job 71 on n2: continued the training (continuation 1)" in text
    assert "job stopped by the time-limit warning at layer 'Background' epoch 3 batch 2 of 5 after 10 min 0 s" in text
    assert text.count("  layer Background\n") + text.count("layer Background\n") >= 1
    assert any(line.startswith("  epoch 2 (again: the job was restarted after it)") for line in lines)
    # The repeated epoch replaced the first one's record: the best is the retrained 0.85 at epoch 2.
    assert "  layer Background: best val_accuracy 0.8500 at epoch 2 of 3 run; its model is the one returned" in lines
    assert lines[-1].endswith("in 21 min 0 s over 2 jobs")


def test_a_failure_is_told(tmp_path: Path) -> None:
    story = TrainingLog.open(tmp_path, clock=Clock())
    story.job_started(request="r", job="1", host="h", continuation=0)
    story.failed("reading the sample zips: 'Sample 1' is not a zip file")
    assert story.text().splitlines()[-1].endswith("failed: reading the sample zips: 'Sample 1' is not a zip file")


def test_a_fresh_start_and_a_model_that_learned_nothing_are_said_in_plain_words(tmp_path: Path) -> None:
    """The trainer's layer events (worker.trainer.train_pages' ``on_layer``) reach the Log File: a fresh
    start, the summary with the trainer's own best epoch, and a WARNING with what to change for a model
    that marks every pixel alike. Mutation caught: a one-class layer summarised as any other (the
    "finished" line and the WARNING are missing), or the summary recomputed from the records (epoch 2)."""
    story = TrainingLog.open(tmp_path, clock=Clock())
    story.job_started(request="req-2", job="7", host="node1", continuation=0)
    story.fresh_start(
        {"event": "fresh_start", "label": "Background", "answer": "every pixel as the layer", "val_loss": 0.7774,
         "start_loss": 0.6931, "fresh_start": 1, "of": 2}
    )  # fmt: skip
    story.epoch(record("Background", 1, 0.91))
    story.epoch(record("Background", 2, 0.95))
    story.layer_trained(
        {"event": "layer_trained", "label": "Background", "best_epoch": 1, "best_val_accuracy": 0.91,
         "epochs_run": 2, "fresh_starts": 1, "one_class": None},
        "Background Model",
    )  # fmt: skip
    story.epoch(record("Layer 2", 1, 0.874))
    story.layer_trained(
        {"event": "layer_trained", "label": "Layer 2", "best_epoch": 1, "best_val_accuracy": 0.874,
         "epochs_run": 1, "fresh_starts": 2, "one_class": "no pixel as the layer"},
        "Model 2",
    )  # fmt: skip
    story.finished(["Background Model", "Model 2"])
    text = (tmp_path / LOG_NAME).read_text()
    lines = text.splitlines()
    header = lines.index(next(line for line in lines if line.endswith("layer Background")))
    assert (
        "no better than a model that knows nothing (val_loss 0.7774, the constant answer's 0.6931; "
        "it marks every pixel as the layer)" in lines[header + 1]
    )
    assert "fresh start 1 of 2" in lines[header + 1]
    assert (
        "  layer Background: best val_accuracy 0.9100 at epoch 1 of 2 run, after 1 fresh start; "
        "its model is the one returned as Background Model"
    ) in lines
    assert text.count("layer Background: best val_accuracy") == 1  # not summarised again by finished()
    warning = next(line for line in lines if "WARNING" in line)
    assert warning.startswith("  WARNING: Model 2 (layer Layer 2) learned nothing: it marks no pixel as the layer")
    assert "'Maximum number of samples per label'" in text and "larger patch" in text
    assert lines[-1] == "  1 of the 2 models learned nothing (Model 2): see the WARNING above"
    # The state survives into a continuation's log object.
    again = TrainingLog.open(tmp_path, clock=Clock())
    assert again._state.learned_nothing == ["Model 2"]


def test_a_model_that_marks_almost_nothing_is_warned_of_as_learned_nothing(tmp_path: Path) -> None:
    """A kept model that marks less than a tenth of the layer's share (the trainer's "almost no pixel as
    the layer") is a model that learned nothing, said so with "almost" (mutation caught: the WARNING
    claiming "every pixel" for it, or no WARNING for an answer other than the exact ones)."""
    story = TrainingLog.open(tmp_path, clock=Clock())
    story.job_started(request="req-3", job="8", host="node1", continuation=0)
    story.epoch(record("Layer 2", 1, 0.749))
    story.layer_trained(
        {"event": "layer_trained", "label": "Layer 2", "best_epoch": 1, "best_val_accuracy": 0.749,
         "epochs_run": 1, "fresh_starts": 2, "one_class": "almost no pixel as the layer"},
        "Model 2",
    )  # fmt: skip
    story.finished(["Model 2"])
    lines = (tmp_path / LOG_NAME).read_text().splitlines()
    warning = next(line for line in lines if "WARNING" in line)
    assert "it marks almost no pixel as the layer on the validation patches" in warning
    assert "it will give almost every pixel the same answer" in warning
    assert lines[-1] == "  1 of the 1 models learned nothing (Model 2): see the WARNING above"
