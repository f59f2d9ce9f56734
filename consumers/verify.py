"""Does each consumer open a model file, predict what its weights predict, and train it on?

For every model file and consumer (see :mod:`consumers`):

- **load**: ``tensorflow.keras.models.load_model(path)``, as Rodan calls it;
- **predict**: on windows of a page at the training patch size and at a larger size
  (both multiples of 4), compared with a reference: the SAE built here (Keras 3) and given
  the file's weights, read from the HDF5 datasets *by layer name* (the readers assign them
  by position, so a layer order mixed up in the file shows here). Within
  :data:`PREDICTION_TOLERANCE`;
- **fit**: one step of ``fit`` on one batch, compared with the same step taken here with
  the original trainer's loss, metric and optimizer (binary cross-entropy, accuracy, Adam(1e-4)), from
  the file's Adam state when it holds one, else a fresh Adam. The step (the change of every
  weight) must lie within :data:`STEP_TOLERANCE` of ours, relative to its length, and (for
  a file with Adam's state) :data:`STATE_MARGIN` times further from a fresh-Adam step, so a
  consumer that silently dropped the state does not pass. Relative, because Adam's first
  step moves each weight by about ``lr * g / (|g| + 3e-6)``: where a gradient is at the
  noise level of float32 sums (TensorFlow 2.5's Eigen kernels add in another order than
  oneDNN's), that weight moves differently (seen: up to 3e-5 on a few hundred of 1.4
  million weights, 0.4 % of the step's length) while the step as a whole is the same.

Keras 3 cannot continue training any HDF5 file that holds optimizer state (see
:mod:`worker.trainer.saving`); that one failure is reported as :attr:`Verdict.known_defect`.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import h5py
import numpy as np
import numpy.typing as npt
from PIL import Image

from consumers import CONSUMERS, Consumer, run_check
from worker.trainer import keras
from worker.trainer.dataset import network_input  # BGR, (255 - v) / 255: what Rodan's classifier feeds
from worker.trainer.distribute import dtype_policy
from worker.trainer.model import build_sae, compile_sae

#: Largest difference allowed between a consumer's probabilities and the reference's.
PREDICTION_TOLERANCE = 1e-5
#: Largest distance allowed between the consumer's fit step and ours, relative to ours
#: (L2 norms of the change of all weights).
STEP_TOLERANCE = 0.02
#: With Adam's state in the file: how many times further from a fresh-Adam step the consumer's
#: step must be than from the restored-state step.
STATE_MARGIN = 10.0
#: What Keras 3 raises when fitting a model whose HDF5 optimizer state it loaded.
KERAS3_OPTIMIZER_DEFECT = "Unknown variable"


@dataclasses.dataclass
class Verdict:
    """One model file in one consumer."""

    model: str
    consumer: str
    environment: dict[str, str]
    optimizer_state: bool  # the file holds Adam's state
    error: str | None = None  # the first check that failed, and how
    input_shape: list[Any] | None = None
    prediction_diff: float | None = None
    step_error: float | None = None  # |their step - ours| / |ours|
    fresh_step_error: float | None = None  # |their step - a fresh Adam's| / |a fresh Adam's|
    known_defect: bool = False  # Keras 3 cannot fit HDF5 optimizer state (see the module docstring)
    own_serialization: bool | None = None  # this Keras, re-serializing the loaded model, writes the file's config

    @property
    def loads(self) -> bool:
        return self.input_shape is not None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def acceptable(self) -> bool:
        """Passed, or failed only on the known Keras 3 defect."""
        return self.ok or self.known_defect

    def summary(self) -> str:
        if self.ok:
            return f"ok (Δp {self.prediction_diff:.0e}, Δstep {self.step_error:.0e})"
        if self.known_defect:
            return f"loads, Δp {self.prediction_diff:.0e}; fit needs compile=False (Keras 3 defect)"
        return f"FAILS: {self.error}"


def page_image(path: Path | None) -> npt.NDArray[np.uint8]:
    """An RGB page to cut windows from: ``path``, or a fixed random one."""
    if path is None:
        return np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)
    with Image.open(path) as image:
        return np.array(image.convert("RGB"), dtype=np.uint8)


def probe_inputs(image: npt.NDArray[np.uint8], patch: tuple[int, int], seed: int = 0) -> dict[str, npt.NDArray[Any]]:
    """Windows of ``image``: 4 of the patch size (``x_fit``, with ``y_fit`` = the darker pixels),
    and 2 larger ones (``x_large``, 32 rows and 64 columns more) when the page has room."""
    rng = np.random.default_rng(seed)
    height, width = image.shape[:2]
    ph, pw = patch

    def windows(h: int, w: int, n: int) -> npt.NDArray[np.float32]:
        rows = rng.integers(0, height - h + 1, n)
        cols = rng.integers(0, width - w + 1, n)
        return network_input(np.stack([image[r : r + h, c : c + w] for r, c in zip(rows, cols, strict=True)]))

    x_fit = windows(ph, pw, 4)
    data = {"x_fit": x_fit, "y_fit": (x_fit.mean(axis=-1, keepdims=True) > 0.5).astype(np.float32)}
    if height >= ph + 32 and width >= pw + 64:
        data["x_large"] = windows(ph + 32, pw + 64, 2)
    return data


def _file_weights(f: h5py.File) -> dict[str, list[npt.NDArray[Any]]]:
    group = f["model_weights"]
    out = {}
    for layer in group:
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in group[layer].attrs["weight_names"]]
        out[layer] = [np.asarray(group[layer][name]) for name in names]
    return out


def _file_adam(f: h5py.File) -> dict[str, npt.NDArray[Any]] | None:
    if "optimizer_weights" not in f:
        return None
    group = f["optimizer_weights"]
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in group.attrs["weight_names"]]
    return {name: np.asarray(group[name]) for name in names}


def reference(path: Path, data: Mapping[str, npt.NDArray[Any]]) -> dict[str, Any]:
    """What the file's weights predict, and the weights after one fit step (restored and fresh Adam)."""
    with h5py.File(path, "r") as f:
        weights, adam = _file_weights(f), _file_adam(f)

    def fresh_model() -> Any:
        with dtype_policy("float32"):
            model = build_sae(None, None)
        for layer in model.layers:
            if layer.weights:
                layer.set_weights(weights[layer.name])  # by name, not by position
        return model

    def step(model: Any, state: Mapping[str, npt.NDArray[Any]] | None) -> list[npt.NDArray[Any]]:
        compile_sae(model)
        if state is not None:
            optimizer = model.optimizer
            optimizer.build(model.trainable_variables)
            by_path = {v.path.split("/", 1)[1]: v for v in optimizer.variables}
            by_path["iteration"].assign(state["Adam/iter:0"])
            for variable in model.trainable_variables:
                stem = variable.path.replace("/", "_")
                by_path[f"{stem}_momentum"].assign(state[f"Adam/{variable.path}/m:0"])
                by_path[f"{stem}_velocity"].assign(state[f"Adam/{variable.path}/v:0"])
        x, y = data["x_fit"], data["y_fit"]
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        return [np.asarray(w) for w in model.get_weights()]

    model = fresh_model()
    out: dict[str, Any] = {
        "p_" + key[2:]: model.predict(value, verbose=0) for key, value in data.items() if key.startswith("x_")
    }
    out["before"] = [np.asarray(w) for w in model.get_weights()]
    out["step"] = step(model, adam)
    out["fresh_step"] = step(fresh_model(), None) if adam is not None else out["step"]
    out["optimizer_state"] = adam is not None
    keras.backend.clear_session()
    return out


def _step_error(
    before: Sequence[npt.NDArray[Any]], expected: Sequence[npt.NDArray[Any]], got: Sequence[npt.NDArray[Any]]
) -> float:
    """|got - expected| / |expected - before|: how far a step is from the expected one, relatively."""
    if len(got) != len(expected):
        return float("inf")
    wide = [np.asarray(x, np.float64).ravel() for x in (*before, *expected, *got)]
    n = len(before)
    start, want, have = np.concatenate(wide[:n]), np.concatenate(wide[n : 2 * n]), np.concatenate(wide[2 * n :])
    return float(np.linalg.norm(have - want) / max(np.linalg.norm(want - start), 1e-30))


def _max_diff(ours: Sequence[npt.NDArray[Any]], theirs: Sequence[npt.NDArray[Any]]) -> float:
    if len(ours) != len(theirs):
        return float("inf")
    pairs = zip(ours, theirs, strict=True)
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in pairs)


def judge(name: str, consumer: Consumer, result: Mapping[str, Any], ref: Mapping[str, Any]) -> Verdict:
    """Turn one check_model.py result into a Verdict against the reference."""
    verdict = Verdict(name, consumer.name, dict(result["environment"]), bool(ref["optimizer_state"]))
    if "load_error" in result:
        verdict.error = f"load_model: {result['load_error']}"
        return verdict
    verdict.input_shape = result["input_shape"]
    verdict.own_serialization = result.get("config_is_own_serialization")
    with np.load(result["arrays"]) as arrays:
        got = {key: arrays[key] for key in arrays.files}
    keys = sorted(key for key in ref if key.startswith("p_"))
    problems = []
    if "predict_error" in result or any(key not in got for key in keys):
        problems.append(f"predict: {result.get('predict_error', 'no predictions')}")
    else:
        verdict.prediction_diff = _max_diff([ref[k] for k in keys], [got[k] for k in keys])
        if verdict.prediction_diff > PREDICTION_TOLERANCE:
            problems.append(f"predictions differ by {verdict.prediction_diff:.2e} (> {PREDICTION_TOLERANCE:g})")
    optimizer = result.get("optimizer") or {}
    expected = {"learning_rate": 1e-4, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}
    if result.get("loss") != "binary_crossentropy" or optimizer.get("class") != "Adam":
        problems.append(f"compiled with loss {result.get('loss')!r}, optimizer {optimizer.get('class')!r}")
    elif any(not np.isclose(optimizer["config"].get(k), v, rtol=1e-6) for k, v in expected.items()):
        problems.append(f"Adam configured as {optimizer['config']}")
    if "fit_error" in result:
        verdict.known_defect = (
            not problems
            and consumer.python_version is None
            and verdict.optimizer_state
            and KERAS3_OPTIMIZER_DEFECT in result["fit_error"]
        )
        problems.append(f"fit: {result['fit_error']}")
    else:
        steps = [got[f"w_{i}"] for i in range(len(ref["step"])) if f"w_{i}" in got]
        verdict.step_error = _step_error(ref["before"], ref["step"], steps)
        verdict.fresh_step_error = _step_error(ref["before"], ref["fresh_step"], steps)
        if "accuracy" not in result["fit"]:
            problems.append(f"fit reported {sorted(result['fit'])}, no accuracy")
        if verdict.step_error > STEP_TOLERANCE:
            off = f"{verdict.step_error:.1%}"
            problems.append(f"one fit step is {off} off the original trainer's (> {STEP_TOLERANCE:.0%})")
        elif verdict.optimizer_state and verdict.fresh_step_error < STATE_MARGIN * max(verdict.step_error, 1e-9):
            problems.append("the fit step is no closer to the saved Adam state than to a fresh Adam")
    verdict.error = "; ".join(problems) or None
    return verdict


def verify(
    models: Mapping[str, Path],
    image: npt.NDArray[np.uint8],
    patch: tuple[int, int],
    consumers: Sequence[Consumer] = CONSUMERS,
) -> list[Verdict]:
    """Check every model in every consumer; one Verdict per (model, consumer), models first."""
    with tempfile.TemporaryDirectory(prefix="hpc-consumers-") as scratch:
        work = Path(scratch)
        data: dict[str, Any] = probe_inputs(image, patch)
        np.savez(work / "data.npz", **data)
        refs = {name: reference(path, data) for name, path in models.items()}
        results = {
            consumer.name: run_check(consumer, list(models.values()), work / "data.npz", work / consumer.name)
            for consumer in consumers
        }
        return [
            judge(name, consumer, results[consumer.name][index], refs[name])
            for index, name in enumerate(models)
            for consumer in consumers
        ]


def print_table(verdicts: Sequence[Verdict], out: IO[str], sizes: Mapping[str, int] | None = None) -> None:
    """One row per model, one column per consumer, then what each failure was."""
    consumers = list(dict.fromkeys(v.consumer for v in verdicts))
    models = list(dict.fromkeys(v.model for v in verdicts))
    cell = {(v.model, v.consumer): v for v in verdicts}
    width = max(len(m) for m in models) + 2

    def mark(v: Verdict) -> str:
        return "ok" if v.ok else ("ok, no fit*" if v.known_defect else "FAILS")

    out.write(f"{'model':<{width}}{'bytes' if sizes else '':>12}  " + "".join(f"{c:<18}" for c in consumers) + "\n")
    for model in models:
        size = f"{sizes[model]:>12,}" if sizes else " " * 12
        out.write(f"{model:<{width}}{size}  " + "".join(f"{mark(cell[model, c]):<18}" for c in consumers) + "\n")
    for name in consumers:
        env = next(v.environment for v in verdicts if v.consumer == name)
        versions = f"Python {env.get('python')}, TensorFlow {env.get('tensorflow')}, Keras {env.get('keras')}"
        out.write(f"  {name}: {versions}\n")
    passed = [v for v in verdicts if v.ok]
    if passed:
        worst_p = max(v.prediction_diff or 0.0 for v in passed)
        worst_s = max(v.step_error or 0.0 for v in passed)
        out.write(
            f"ok: tensorflow.keras.models.load_model(path) as Rodan calls it; predict within {PREDICTION_TOLERANCE:g} "
            f"of the weights (largest difference {worst_p:.1e}) at the patch size and larger; one fit step with the "
            f"original trainer's loss, metric and Adam within {STEP_TOLERANCE:.0%} of ours (largest {worst_s:.2%})\n"
        )
    if any(v.known_defect for v in verdicts):
        out.write(
            "*: loads and predicts; Keras 3 cannot fit any HDF5 file holding optimizer state (load it with "
            "compile=False and compile it: see worker/trainer/saving.py)\n"
        )
    for v in verdicts:
        if not v.acceptable:
            out.write(f"FAILS: {v.model} in {v.consumer}: {v.error}\n")
