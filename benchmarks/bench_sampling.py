"""Benchmark 1: patch-centre sampling on a real page, vectorised vs the original per-pixel loop.

Reads the real Einsiedeln annotation layers (the data set kept beside the checkout, :data:`DATA`; RGBA PNGs of
4872 x 12992 pixels: a pixel belongs to a layer where its alpha is 255; the layers
Background, Neumes and StaffLines, each ANDed with SelectedRegions, as the worker does),
then times, with the same masks and the default settings (256 x 256 patches, at most
10000 samples per label, factor 100):

- ``vectorised``: :func:`worker.trainer.sampling.sample_centres` (the product), best of
  ``--repeats`` runs;
- ``original``: :func:`benchmarks.original_sampler.original_sample`, the original trainer's Python loop over
  every pixel (run once: about 5 s on the full page).

and prints a Markdown table: method, seconds, samples per layer, speed-up; then the peak memory
that each allocates (tracemalloc, measured in separate untimed runs, since tracing slows
the loop down) and the process's peak RSS (which is mostly the decoded PNGs).

    .venv/bin/python benchmarks/bench_sampling.py              # the full page
    .venv/bin/python benchmarks/bench_sampling.py --rows 2000  # the first 2000 rows only
    .venv/bin/python benchmarks/bench_sampling.py --quick      # smoke test: 1500 rows, 1 run, no traced runs

On 2 cores the full page takes about a minute and a half: decoding the PNGs (~10 s), the
loop (~5 s), then its traced run (tracemalloc slows it down ~10x; ``--no-memory`` skips
the traced runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.original_sampler import original_sample  # noqa: E402
from benchmarks.tables import print_table  # noqa: E402


def _load_sampling() -> ModuleType:
    """``worker/trainer/sampling.py`` (NumPy only), without its package, which imports TensorFlow."""
    spec = importlib.util.spec_from_file_location("worker_trainer_sampling", REPO / "worker/trainer/sampling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sample_centres = _load_sampling().sample_centres

DATA = REPO.parent / "shared" / "data" / "einsiedeln-32r-263v"  # shared/ beside the checkout
LAYERS = ("Background", "Neumes", "StaffLines")
Image.MAX_IMAGE_PIXELS = None  # 63 M pixels: above Pillow's decompression-bomb warning


def opaque(path: Path) -> npt.NDArray[np.bool_]:
    """Where the PNG's alpha is 255."""
    with Image.open(path) as image:
        alpha = np.asarray(image.getchannel("A"), dtype=np.uint8)
    mask: npt.NDArray[np.bool_] = alpha == 255
    return mask


def load_masks(data: Path, rows: int | None) -> dict[str, npt.NDArray[np.bool_]]:
    """The layer masks ANDed with the selected regions, restricted to the first ``rows`` rows."""
    regions = opaque(data / "SelectedRegions.png")
    masks = {}
    for label in LAYERS:
        mask = opaque(data / f"{label}.png")
        mask &= regions
        masks[label] = np.ascontiguousarray(mask[:rows]) if rows is not None else mask
    return masks


def traced_peak(run: Callable[[], Any]) -> int:
    """Bytes ``run`` allocates at its peak (Python and NumPy allocations, via tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the layer PNGs (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows of the page (default: all)")
    parser.add_argument("--patch", type=int, default=256, help="patch height and width (default: %(default)s)")
    parser.add_argument("--max-samples", type=int, default=10_000, help="samples per label (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the vectorised sampler (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the traced (untimed) memory runs")
    parser.add_argument("--quick", action="store_true", help="smoke test: --rows 1500 --repeats 1 --no-memory")
    args = parser.parse_args(argv)
    if args.quick:  # these replace the defaults; options given still win
        parser.set_defaults(rows=1500, repeats=1, no_memory=True)
        args = parser.parse_args(argv)

    start = time.perf_counter()
    masks = load_masks(args.data, args.rows)
    height, width = next(iter(masks.values())).shape
    mask_bytes = height * width
    print(
        f"page: {width} x {height} px ({height * width / 1e6:.1f} M), layers loaded in "
        f"{time.perf_counter() - start:.1f} s"
    )
    for label, mask in masks.items():
        print(f"  {label:<11} {np.count_nonzero(mask):>11,d} px")
    print(f"settings: {args.patch} x {args.patch} patches, at most {args.max_samples} samples per label, factor 100")
    print()

    def vectorised() -> dict[str, int]:
        found = sample_centres(masks, args.patch, args.patch, args.max_samples, np.random.default_rng(args.seed))
        return {label: len(centres) for label, centres in found.items()}

    def loop() -> dict[str, int]:
        found = original_sample(
            masks, args.patch, args.patch, args.max_samples, random_source=random.Random(args.seed).random
        )
        return {label: len(centres) for label, centres in found.items()}

    times = []
    for _ in range(max(1, args.repeats)):
        start = time.perf_counter()
        vec_counts = vectorised()
        times.append(time.perf_counter() - start)
    vec_seconds = min(times)
    start = time.perf_counter()
    loop_counts = loop()
    loop_seconds = time.perf_counter() - start

    rows = [
        [name, f"{seconds:.4f}", *(f"{counts[label]:,d}" for label in LAYERS), f"{loop_seconds / seconds:.0f}x"]
        for name, seconds, counts in (("original", loop_seconds, loop_counts), ("vectorised", vec_seconds, vec_counts))
    ]
    print_table(["method", "seconds", *LAYERS, "speed-up"], rows)
    print(
        f"(vectorised: best of {len(times)} runs, all {', '.join(f'{t:.4f}' for t in times)} s; "
        "the columns per layer are the samples drawn)"
    )

    if not args.no_memory:
        print()
        vec_peak = traced_peak(vectorised)
        loop_peak = traced_peak(loop)
        print(f"peak traced allocations (tracemalloc, untimed runs; one bool mask = {mask_bytes / 2**20:.1f} MiB):")
        print(f"  original    {loop_peak / 2**20:>8.2f} MiB")
        print(f"  vectorised  {vec_peak / 2**20:>8.2f} MiB")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the whole process (decoded PNGs included): {peak_rss:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
