"""Repeated use (issue 17, item 6), CPU engine: load/close cycles leave host memory where it was,
and threads loading and reducing at once get the same results as one thread.

The GPU forms of both (card memory, CUDA datasets) run on the device: `tests/gpu/soak.py cycles`
and `threads`, from `bench/device.sh soak`.
"""

from __future__ import annotations

import gc
import os

import h5py
import numpy as np
from concurrency import on_threads

from quantem.gpu import detector, io


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _source(tmp_path):
    rng = np.random.default_rng(11)
    data = rng.poisson(3.0, size=(12, 10, 24, 20)).astype(np.uint16)
    path = tmp_path / "cycles.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data, chunks=(1, 1, 24, 20))
    return path, data


def _cycle(path):
    with io.load(path, backend="cpu") as ds:
        return detector.sum_dp(ds)


def test_two_hundred_load_close_cycles_keep_host_memory_flat(tmp_path):
    path, data = _source(tmp_path)
    want = data.astype(np.uint64).sum(axis=(0, 1))
    # Warm-up: thread pools, allocator arenas and the index cache reach their size (measured:
    # RSS grows for the first ~300 cycles, then stays put to the page).
    for _ in range(400):
        _cycle(path)
    gc.collect()
    base = _rss()
    for _ in range(200):
        got = _cycle(path)
    gc.collect()
    end = _rss()
    assert np.array_equal(got, want)
    assert end <= base * 1.01, f"host RSS {base} -> {end} bytes over 200 load/close cycles"


def test_four_threads_loading_and_reducing_at_once_agree(tmp_path):
    path, data = _source(tmp_path)
    want = data.astype(np.uint64).sum(axis=(0, 1))
    mask = (np.arange(24 * 20).reshape(24, 20) % 3 == 0).astype(np.int32)
    want_img = (data.astype(np.uint64) * mask).sum(axis=(2, 3))
    results: list = [None] * 4

    def work(i: int) -> None:
        for _ in range(5):
            with io.load(path, backend="cpu", representation="encoded" if i % 2 else "dense") as ds:
                results[i] = (detector.sum_dp(ds), detector.virtual_image(ds, mask))

    errors = on_threads(work, 4)
    assert not errors, errors
    for i, (s, img) in enumerate(results):
        assert np.array_equal(s, want), f"thread {i}"
        assert np.array_equal(img, want_img), f"thread {i}"
