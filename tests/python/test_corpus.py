"""The malformed-input corpus: every bad argument and bad source gives its typed error.

Each case names the call, the exception type it must raise and a substring of the message (the
argument or file it names). Wrong types raise ``ArgumentTypeError`` (an ``InvalidArgumentError``
and a ``TypeError``); wrong values ``InvalidArgumentError``; bad sources ``SourceError`` (or
``QuantemIOError`` for operating-system failures). The bad sources also go through the
console script (``quantem-gpu inspect PATH``), whose exit code must be in the documented set
and bad input must be 3; no case may make Rust panic.

One case is marked ``xfail``: a known gap left to the formats work (a data shard loaded alone
with ``scan_shape`` is not yet refused in favour of its master).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import write_acquisition

import quantem.gpu as qg
from quantem.gpu import detector, device, dpc, io, ssb

ARR = (np.arange(4 * 5 * 6 * 7) % 13).astype(np.uint16).reshape(4, 5, 6, 7)
NAN = float("nan")
INF = float("inf")

#: Documented exit codes: 0 ok, 2 usage, 3 bad input/source, 4 backend unavailable, 5 budget.
EXIT_CODES = {0, 2, 3, 4, 5}

ArgT = qg.ArgumentTypeError
Inv = qg.InvalidArgumentError


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    ds = io.load(ARR, backend="cpu")
    closed = io.load(ARR, backend="cpu")
    closed.close()
    return {
        "tmp": tmp,
        "ds": ds,
        "closed": closed,
        "ssb": ssb.SSB(ds, voltage_kv=300, semiangle_mrad=25, scan_step_a=0.5),
        "one": io.load(ARR[:1, :1], backend="cpu"),
    }


def _ssb(ds, **kw):
    args = dict(voltage_kv=300, semiangle_mrad=25, scan_step_a=0.5)
    args.update(kw)
    return ssb.SSB(ds, **args)


# (id, call(ctx), exception, message substring[, marks])
ARGUMENT_CASES = [
    # io.load: sources
    ("load-int-source", lambda c: io.load(12345), ArgT, "source"),
    ("load-float-array", lambda c: io.load(ARR.astype(np.float32)), Inv, "float32"),
    ("load-2d-array", lambda c: io.load(ARR[0, 0]), Inv, "dimensions"),
    ("load-nul-path", lambda c: io.load("a\0b_master.h5"), Inv, "NUL"),
    ("load-empty-path", lambda c: io.load(""), Inv, "source is empty"),
    # io.load: integers
    ("load-bin-zero", lambda c: io.load(ARR, det_bin=0), Inv, "det_bin"),
    ("load-bin-negative", lambda c: io.load(ARR, det_bin=-2), Inv, "det_bin"),
    ("load-bin-float", lambda c: io.load(ARR, det_bin=1.5), ArgT, "det_bin"),
    ("load-bin-bool", lambda c: io.load(ARR, det_bin=True), ArgT, "det_bin"),
    ("load-bin-huge", lambda c: io.load(ARR, det_bin=2**70), Inv, "det_bin"),
    ("load-scan-shape-zero", lambda c: io.load(ARR, scan_shape=(0, 20)), Inv, "scan_shape[0]"),
    ("load-scan-shape-len", lambda c: io.load(ARR, scan_shape=(20,)), Inv, "scan_shape"),
    ("load-scan-shape-str", lambda c: io.load(ARR, scan_shape="4x5"), ArgT, "scan_shape"),
    (
        "load-scan-shape-mismatch",
        lambda c: io.load(ARR.reshape(20, 6, 7), scan_shape=(3, 3)),
        qg.SourceError,
        "20 frames",
    ),
    (
        "load-scan-shape-overflow",
        lambda c: io.load(ARR.reshape(20, 6, 7), scan_shape=(2**40, 2**40)),
        Inv,
        "scan_shape",
    ),
    # io.load: regions
    ("load-region-reversed", lambda c: io.load(ARR, scan_region=(3, 1, 0, 5)), Inv, "scan_region"),
    ("load-region-empty", lambda c: io.load(ARR, scan_region=(1, 1, 0, 5)), Inv, "scan_region"),
    (
        "load-region-float",
        lambda c: io.load(ARR, detector_region=(0.5, 10.7, 0, 7)),
        ArgT,
        "detector_region[0]",
    ),
    (
        "load-region-outside",
        lambda c: io.load(ARR, detector_region=(0, 100, 0, 7)),
        Inv,
        "detector_region",
    ),
    ("load-region-3", lambda c: io.load(ARR, scan_region=(0, 1, 0)), Inv, "scan_region"),
    ("load-region-negative", lambda c: io.load(ARR, scan_region=(-1, 2, 0, 2)), Inv, "scan_region"),
    # io.load: names, flags, budgets
    ("load-dtype-unknown", lambda c: io.load(ARR, dtype="f32"), Inv, "dtype"),
    ("load-dtype-numpy-float", lambda c: io.load(ARR, dtype=np.float64), Inv, "dtype"),
    ("load-dtype-int", lambda c: io.load(ARR, dtype=16), ArgT, "dtype"),
    ("load-representation", lambda c: io.load(ARR, representation="sparse"), Inv, "sparse"),
    ("load-representation-type", lambda c: io.load(ARR, representation=1), ArgT, "representation"),
    ("load-mask-str", lambda c: io.load(ARR, apply_mask="no"), ArgT, "apply_mask"),
    ("load-mask-none", lambda c: io.load(ARR, apply_mask=None), ArgT, "apply_mask"),
    ("load-budget-negative", lambda c: io.load(ARR, memory_budget=-1), Inv, "memory_budget"),
    ("load-budget-float", lambda c: io.load(ARR, memory_budget=1e9), ArgT, "memory_budget"),
    ("load-budget-small", lambda c: io.load(ARR, memory_budget=10), qg.MemoryBudgetError, "10"),
    ("load-backend-unknown", lambda c: io.load(ARR, backend="tpu"), Inv, "tpu"),
    ("load-backend-type", lambda c: io.load(ARR, backend=None), ArgT, "backend"),
    ("load-progress", lambda c: io.load(ARR, progress=5), ArgT, "progress"),
    ("load-dataset-path", lambda c: io.load(ARR, dataset_path=5), ArgT, "dataset_path"),
    # io.inspect / io.save / io.discover
    ("inspect-source-none", lambda c: io.inspect(None), ArgT, "source"),
    ("inspect-scan-shape", lambda c: io.inspect("x.h5", scan_shape=(2, -1)), Inv, "scan_shape"),
    ("save-no-dataset", lambda c: io.save(None, c["tmp"] / "x.qem"), ArgT, "dataset"),
    ("save-path-type", lambda c: io.save(c["ds"], 3), ArgT, "path"),
    (
        "save-missing-folder",
        lambda c: io.save(c["ds"], c["tmp"] / "nodir" / "x.qem"),
        qg.QuantemIOError,
        "nodir",
    ),
    (
        "save-u32",
        lambda c: io.save(io.load(ARR.astype(np.uint32)), c["tmp"] / "u32.qem"),
        Inv,
        "u32",
    ),
    ("discover-type", lambda c: io.discover(1.0), ArgT, "folder"),
    # detector
    ("sum-dp-not-dataset", lambda c: detector.sum_dp(ARR), ArgT, "Dataset"),
    ("annular-inner-gt-outer", lambda c: detector.annular(c["ds"], 5.0, 2.0), Inv, "inner"),
    ("adf-inner-negative", lambda c: detector.adf(c["ds"], inner=-1.0), Inv, "inner"),
    ("adf-outer-nan", lambda c: detector.adf(c["ds"], outer=NAN), Inv, "outer"),
    ("adf-outer-inf", lambda c: detector.adf(c["ds"], outer=INF), Inv, "outer"),
    ("adf-radius-zero", lambda c: detector.adf(c["ds"], radius=0), Inv, "radius"),
    ("adf-radius-str", lambda c: detector.adf(c["ds"], radius="3"), ArgT, "radius"),
    ("adf-center-len", lambda c: detector.adf(c["ds"], center=(1.0,)), Inv, "center"),
    ("adf-center-nan", lambda c: detector.adf(c["ds"], center=(NAN, 1.0)), Inv, "center[0]"),
    ("adf-unit", lambda c: detector.adf(c["ds"], unit="deg"), Inv, "unit"),
    (
        "adf-mrad-uncalibrated",
        lambda c: detector.adf(c["ds"], unit="mrad", inner=1.0, outer=2.0),
        Inv,
        "semiangle_mrad",
    ),
    ("adf-semiangle", lambda c: detector.adf(c["ds"], semiangle_mrad=-5), Inv, "semiangle_mrad"),
    (
        "adf-sampling",
        lambda c: detector.adf(c["ds"], det_sampling_mrad=0.0),
        Inv,
        "det_sampling_mrad",
    ),
    ("products-none", lambda c: detector.products(c["ds"], []), Inv, "nothing requested"),
    ("products-unknown", lambda c: detector.products(c["ds"], ["xyz"]), Inv, "xyz"),
    ("products-type", lambda c: detector.products(c["ds"], [3]), ArgT, "product name"),
    (
        "products-inner-several",
        lambda c: detector.products(c["ds"], ["bf", "adf"], inner=1.0),
        Inv,
        "several detectors",
    ),
    ("frames-outside", lambda c: detector.frames(c["ds"], [(10, 0)]), Inv, "outside the scan"),
    ("frames-negative", lambda c: detector.frames(c["ds"], [(-1, 0)]), Inv, "positions[0] row"),
    ("frames-float", lambda c: detector.frames(c["ds"], [(0, 1.0)]), ArgT, "positions[0]"),
    ("roi-two-regions", lambda c: detector.roi_dp(c["ds"], (0, 1, 0, 1), (1, 1, 1)), Inv, "one"),
    ("roi-rect-reversed", lambda c: detector.roi_dp(c["ds"], rect=(2, 1, 0, 1)), Inv, "rect"),
    (
        "roi-circle-radius",
        lambda c: detector.roi_dp(c["ds"], circle=(1, 1, -1)),
        Inv,
        "circle radius",
    ),
    (
        "roi-reduce",
        lambda c: detector.roi_dp(c["ds"], rect=(0, 1, 0, 1), reduce="median"),
        Inv,
        "reduce",
    ),
    (
        "virtual-mask-shape",
        lambda c: detector.virtual_image(c["ds"], np.ones((6, 6), bool)),
        Inv,
        "shape (6, 7)",
    ),
    (
        "virtual-mask-negative",
        lambda c: detector.virtual_image(c["ds"], -np.ones((6, 7), np.int64)),
        Inv,
        "out of range",
    ),
    (
        "virtual-mask-nan",
        lambda c: detector.virtual_image(c["ds"], np.full((6, 7), NAN)),
        Inv,
        "not finite",
    ),
    # dpc
    ("com-centered", lambda c: dpc.center_of_mass(c["ds"], centered="yes"), ArgT, "centered"),
    ("dpc-rotation-nan", lambda c: dpc.run(c["ds"], rotation_deg=NAN), Inv, "rotation_deg"),
    ("dpc-rotation-str", lambda c: dpc.run(c["ds"], rotation_deg="90"), ArgT, "rotation_deg"),
    ("dpc-transpose-int", lambda c: dpc.run(c["ds"], transpose=1), ArgT, "transpose"),
    ("dpc-edge", lambda c: dpc.run(c["ds"], edge="wrap"), Inv, "edge"),
    (
        "integrate-shapes",
        lambda c: dpc.integrate(np.zeros((4, 4)), np.zeros((4, 5))),
        Inv,
        "same shape",
    ),
    (
        "integrate-inf",
        lambda c: dpc.integrate(np.zeros((4, 4)), np.full((4, 4), INF)),
        Inv,
        "g_col",
    ),
    # ssb
    ("ssb-voltage-missing", lambda c: _ssb(c["ds"], voltage_kv=None), Inv, "voltage_kv"),
    ("ssb-voltage-negative", lambda c: _ssb(c["ds"], voltage_kv=-300), Inv, "voltage_kv"),
    ("ssb-voltage-nan", lambda c: _ssb(c["ds"], voltage_kv=NAN), Inv, "voltage_kv"),
    ("ssb-voltage-str", lambda c: _ssb(c["ds"], voltage_kv="300"), ArgT, "voltage_kv"),
    ("ssb-semiangle-zero", lambda c: _ssb(c["ds"], semiangle_mrad=0), Inv, "semiangle_mrad"),
    ("ssb-step-3", lambda c: _ssb(c["ds"], scan_step_a=(1, 2, 3)), Inv, "scan_step_a"),
    ("ssb-sampling", lambda c: _ssb(c["ds"], det_sampling_mrad=-1), Inv, "det_sampling_mrad"),
    ("ssb-threshold", lambda c: _ssb(c["ds"], bf_threshold=1.5), Inv, "bf_threshold"),
    ("ssb-compat-flag", lambda c: _ssb(c["ds"], compat_2alpha="no"), ArgT, "compat_2alpha"),
    ("ssb-g-storage", lambda c: _ssb(c["ds"], g_storage="f64"), Inv, "g_storage"),
    ("ssb-engine", lambda c: _ssb(c["ds"], engine="gpu"), Inv, "engine"),
    ("ssb-budget", lambda c: _ssb(c["ds"], memory_budget=-1), Inv, "memory_budget"),
    ("ssb-aberration-name", lambda c: c["ssb"].reconstruct({"C99": 1.0}), Inv, "C99"),
    ("ssb-aberration-nan", lambda c: c["ssb"].reconstruct({"C10": NAN}), Inv, "C10"),
    ("ssb-seed-negative", lambda c: c["ssb"].fit(seed=-1), Inv, "seed"),
    ("ssb-seed-float", lambda c: c["ssb"].fit(seed=0.0), ArgT, "seed"),
    ("ssb-fit-twice", lambda c: c["ssb"].fit(fit=["C10", "C10"]), Inv, "once"),
    ("ssb-range-reversed", lambda c: c["ssb"].fit(ranges={"C10": (5, -5)}), Inv, "low < high"),
    ("ssb-objective", lambda c: c["ssb"].fit(objective="mse"), Inv, "objective"),
    ("ssb-local-starts", lambda c: c["ssb"].fit(local_starts=0), Inv, "local_starts"),
    ("ssb-fit-1x1", lambda c: _ssb(c["one"]).fit(global_evals=1), Inv, "2 x 2"),
    # a closed dataset
    ("closed-frame", lambda c: c["closed"][0, 0], Inv, "closed"),
    ("closed-to-numpy", lambda c: c["closed"].to_numpy(), Inv, "closed"),
    ("closed-sum-dp", lambda c: detector.sum_dp(c["closed"]), Inv, "closed"),
    ("closed-adf", lambda c: detector.adf(c["closed"]), Inv, "closed"),
    ("closed-dpc", lambda c: dpc.run(c["closed"]), Inv, "closed"),
    ("closed-save", lambda c: io.save(c["closed"], c["tmp"] / "closed.qem"), Inv, "closed"),
    ("closed-ssb", lambda c: _ssb(c["closed"]), Inv, "closed"),
    # frame indices
    ("frame-row-outside", lambda c: c["ds"][4, 0], IndexError, "row"),
    ("frame-col-negative", lambda c: c["ds"][0, -6], IndexError, "column"),
    ("frame-float-index", lambda c: c["ds"][0.5, 0], TypeError, "only integers"),
    # device
    ("resolve-unknown", lambda c: device.resolve("tpu"), Inv, "tpu"),
    ("resolve-type", lambda c: device.resolve(None), ArgT, "name"),
]


def _params(cases):
    out = []
    for case in cases:
        name, call, exc, match, *marks = case
        out.append(pytest.param(call, exc, match, id=name, marks=marks))
    return out


@pytest.mark.parametrize("call, exc, match", _params(ARGUMENT_CASES))
def test_invalid_argument(ctx, call, exc, match):
    with pytest.raises(exc) as e:
        call(ctx)
    assert match in str(e.value), str(e.value)
    if isinstance(e.value, qg.QuantemError):
        # Shaped like the engine's errors: operation first, with expected/found where known.
        assert e.value.op and str(e.value).startswith(e.value.op), str(e.value)


# --- bad sources: the Python call and the console script -------------------------------------


def _make_sources(tmp: Path) -> dict[str, Path]:
    s: dict[str, Path] = {}
    s["missing"] = tmp / "nope_master.h5"
    s["directory"] = tmp / "folder_master.h5"
    s["directory"].mkdir()
    a, b = tmp / "loop_a_master.h5", tmp / "loop_b_master.h5"
    os.symlink(b, a)
    os.symlink(a, b)
    s["symlink_loop"] = a
    s["text_master"] = tmp / "notes_master.h5"
    s["text_master"].write_text("this is a text file, not HDF5\n" * 10)
    s["zero_length"] = tmp / "empty_master.h5"
    s["zero_length"].write_bytes(b"")
    plain = tmp / "plain.h5"
    with h5py.File(plain, "w") as f:
        f.create_dataset("data", data=np.ones((16, 32, 32), np.uint16))
    raw = plain.read_bytes()
    s["truncated_hdf5"] = tmp / "truncated.h5"
    s["truncated_hdf5"].write_bytes(raw[: len(raw) // 2])
    s["huge_shape"] = tmp / "huge.h5"
    with h5py.File(s["huge_shape"], "w") as f:
        f.create_dataset("data", shape=(2**40, 256, 256), dtype=np.uint16, chunks=(1, 256, 256))
    s["fifo"] = tmp / "pipe_master.h5"
    os.mkfifo(s["fifo"])
    s["unreadable"] = tmp / "locked_master.h5"
    shutil.copy(plain, s["unreadable"])
    os.chmod(s["unreadable"], 0)
    _, files, _ = write_acquisition(tmp / "acq", name="scan")
    s["shard"] = files[0]
    return s


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _make_sources(tmp_path_factory.mktemp("sources"))


def _root_skip(name):
    if name == "unreadable" and os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root from reading the file")


# name → (exception types, message substring, marks)
SOURCE_CASES = {
    "missing": ((qg.SourceError,), "nope_master.h5", ()),
    "directory": ((qg.SourceError,), "directory", ()),
    "symlink_loop": ((qg.SourceError,), "symlink loop", ()),
    "text_master": ((qg.SourceError,), "notes_master.h5", ()),
    "zero_length": ((qg.SourceError,), "empty_master.h5", ()),
    "truncated_hdf5": ((qg.SourceError, qg.DecodeError), "truncated.h5", ()),
    "huge_shape": ((qg.SourceError, qg.MemoryBudgetError), "huge.h5", ()),
    "fifo": ((qg.SourceError,), "FIFO", ()),
    "unreadable": ((qg.SourceError, qg.QuantemIOError), "locked_master.h5", ()),
    # A data shard alone loads as a plain HDF5 file without its scan shape: refused for that.
    "shard": ((qg.SourceError,), "scan_data_000001.h5", ()),
}


def _source_params():
    return [
        pytest.param(name, *case[:2], id=name, marks=list(case[2]))
        for name, case in SOURCE_CASES.items()
    ]


@pytest.mark.parametrize("name, excs, match", _source_params())
def test_bad_source_load(sources, name, excs, match):
    _root_skip(name)
    with pytest.raises(excs) as e:
        io.load(sources[name], backend="cpu")
    assert match in str(e.value), str(e.value)


@pytest.mark.parametrize("name, excs, match", _source_params())
def test_bad_source_inspect(sources, name, excs, match):
    _root_skip(name)
    if name in ("huge_shape", "shard"):
        pytest.skip("a readable HDF5 file: inspect reports on it (ready or not) without raising")
    with pytest.raises(excs) as e:
        io.inspect(sources[name])
    assert match in str(e.value), str(e.value)


@pytest.mark.xfail(
    strict=False,
    reason="known gap (the formats issue): a Dectris data shard loaded alone with scan_shape "
    "is read as a plain HDF5 file (8 of 35 frames) instead of being refused in favour of its "
    "master",
)
def test_shard_with_scan_shape_is_refused(sources):
    with pytest.raises(qg.SourceError, match="master"):
        io.load(sources["shard"], scan_shape=(2, 4), backend="cpu")


def _console_script() -> str:
    exe = Path(sys.executable).parent / "quantem-gpu"
    found = str(exe) if exe.exists() else shutil.which("quantem-gpu")
    assert found, "the quantem-gpu console script is not installed next to this Python"
    return found


# The CLI's verdict on each source: 3 (bad input) for all but the readable HDF5 files, where
# inspect reports that the source is not ready (exit 3 too) or succeeds (0).
CLI_EXPECT = {"huge_shape": {0, 3}, "shard": {0, 3}}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, id=n, marks=[]) for n in SOURCE_CASES],
)
def test_bad_source_cli_inspect(sources, name):
    _root_skip(name)
    proc = subprocess.run(
        [_console_script(), "inspect", str(sources[name])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "panicked" not in proc.stderr, proc.stderr
    assert proc.returncode in EXIT_CODES, (proc.returncode, proc.stderr)
    assert proc.returncode in CLI_EXPECT.get(name, {3}), (proc.returncode, proc.stderr)


def test_cli_usage_errors_exit_2(sources):
    for argv in (["inspect"], ["inspect", "--scan-shape", "x", "y", str(sources["shard"])]):
        proc = subprocess.run(
            [_console_script(), *argv], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (argv, proc.returncode, proc.stderr)
        assert "panicked" not in proc.stderr
