"""Argument conversion is strict: nothing is silently coerced (regressions of the Python layer).

Before: ``det_bin=1.5`` loaded with bin 1, ``detector_region=(0.5, 10.7, ...)`` became
``(0, 10, ...)``, ``apply_mask="no"`` meant True, ``det_bin=2**70`` gave a bare
``OverflowError``, a ``bytes`` path was read as an array, SSB took ``voltage_kv="300"``, and a
fit on a 1 x 1 scan returned zeros with loss 0.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantem.gpu as qg
from quantem.gpu import detector, dpc, io, ssb

ARR = np.arange(4 * 5 * 6 * 7, dtype=np.uint16).reshape(4, 5, 6, 7) % 13


@pytest.fixture(scope="module")
def ds():
    return io.load(ARR, backend="cpu")


def check(err, *words):
    """The message names the argument and says what was expected and found."""
    msg = str(err.value)
    for w in words:
        assert w in msg, (w, msg)
    assert err.value.expected and err.value.found, msg
    assert "expected" in msg and "found" in msg, msg


def test_float_bin_is_refused_not_truncated():
    with pytest.raises(qg.ArgumentTypeError) as e:
        io.load(ARR, det_bin=1.5)
    check(e, "det_bin", "1.5")
    assert isinstance(e.value, qg.InvalidArgumentError) and isinstance(e.value, TypeError)


def test_integral_float_bin_is_refused_too():
    with pytest.raises(qg.ArgumentTypeError, match="det_bin"):
        io.load(ARR, det_bin=2.0)


def test_float_region_is_refused_not_truncated():
    with pytest.raises(qg.ArgumentTypeError) as e:
        io.load(ARR, detector_region=(0.5, 10.7, 0, 7))
    check(e, "detector_region[0]", "0.5")


def test_string_flag_is_refused():
    with pytest.raises(qg.ArgumentTypeError) as e:
        io.load(ARR, apply_mask="no")
    check(e, "apply_mask", "'no'")
    with pytest.raises(qg.ArgumentTypeError, match="apply_mask"):
        io.load(ARR, apply_mask=0)


def test_huge_int_names_the_argument():
    with pytest.raises(qg.InvalidArgumentError) as e:
        io.load(ARR, det_bin=2**70)
    check(e, "det_bin", str(2**70))
    assert not isinstance(e.value, OverflowError)
    with pytest.raises(qg.InvalidArgumentError, match="memory_budget"):
        io.load(ARR, memory_budget=2**64)


def test_numpy_integers_and_bools_are_accepted():
    a = io.load(
        ARR,
        det_bin=np.int64(2),
        scan_region=tuple(np.array([1, 3, 0, 5], dtype=np.int32)),
        scan_shape=None,
        apply_mask=np.bool_(False),
        memory_budget=np.uint64(1 << 30),
    )
    assert a.shape == (2, 5, 3, 4)
    b = io.load(ARR, detector_region=np.array([0, 6, 1, 7]), apply_mask=True)
    assert b.shape == (4, 5, 6, 6)


def test_reversed_and_empty_regions():
    with pytest.raises(qg.InvalidArgumentError) as e:
        io.load(ARR, scan_region=(3, 1, 0, 5))
    check(e, "scan_region", "row_start < row_stop")
    with pytest.raises(qg.InvalidArgumentError, match="detector_region.*column"):
        io.load(ARR, detector_region=(0, 6, 4, 4))


def test_bytes_path_is_a_path_not_an_array(tmp_path, ds):
    p = tmp_path / "b.qem"
    io.save(ds, str(p).encode())
    assert p.exists()
    back = io.load(str(p).encode(), backend="cpu")
    assert np.array_equal(back.to_numpy(), ARR)
    with pytest.raises(qg.SourceError, match="missing_master.h5"):
        io.inspect(str(tmp_path / "missing_master.h5").encode())


def test_missing_bytes_path_names_the_file(tmp_path):
    with pytest.raises(qg.QuantemError) as e:
        io.load(str(tmp_path / "nothere_master.h5").encode())
    assert "nothere_master.h5" in str(e.value)
    assert "numpy" not in str(e.value)


def test_unknown_dtype_names():
    with pytest.raises(qg.InvalidArgumentError, match="dtype"):
        io.load(ARR, dtype="float32")
    with pytest.raises(qg.InvalidArgumentError, match="dtype"):
        io.load(ARR, dtype=np.float32)
    with pytest.raises(qg.ArgumentTypeError, match="dtype"):
        io.load(ARR, dtype=16)
    assert io.load(ARR, dtype=np.uint32).dtype == np.uint32


def test_detector_geometry(ds):
    with pytest.raises(qg.InvalidArgumentError) as e:
        detector.annular(ds, inner=5.0, outer=2.0)
    check(e, "inner", "outer")
    with pytest.raises(qg.InvalidArgumentError, match="radius"):
        detector.bf(ds, radius=float("nan"))
    with pytest.raises(qg.InvalidArgumentError, match="inner"):
        detector.adf(ds, inner=-1.0)
    with pytest.raises(qg.ArgumentTypeError, match="center"):
        detector.adf(ds, center="3,3")
    with pytest.raises(qg.ArgumentTypeError, match="outer"):
        detector.adf(ds, outer="4")
    # ints and numpy floats are numbers
    assert detector.annular(ds, inner=np.float32(1), outer=3).image.shape == (4, 5)


def test_frames_positions(ds):
    with pytest.raises(qg.ArgumentTypeError, match="positions"):
        detector.frames(ds, [(0.5, 1)])
    assert detector.frames(ds, [(np.int64(1), 2)]).shape == (1, 6, 7)


def test_dpc_flags(ds):
    with pytest.raises(qg.ArgumentTypeError, match="transpose"):
        dpc.run(ds, transpose="yes")
    with pytest.raises(qg.ArgumentTypeError, match="centered"):
        dpc.center_of_mass(ds, centered=1)
    with pytest.raises(qg.InvalidArgumentError, match="rotation_deg"):
        dpc.run(ds, rotation_deg=float("inf"))
    with pytest.raises(qg.InvalidArgumentError, match="g_row"):
        dpc.integrate(np.full((4, 4), np.nan), np.zeros((4, 4)))


def test_ssb_numbers_are_not_parsed_from_strings(ds):
    with pytest.raises(qg.ArgumentTypeError, match="voltage_kv"):
        ssb.SSB(ds, voltage_kv="300", semiangle_mrad=25, scan_step_a=0.5)
    with pytest.raises(qg.ArgumentTypeError, match="semiangle_mrad"):
        ssb.SSB(ds, voltage_kv=300, semiangle_mrad=True, scan_step_a=0.5)
    with pytest.raises(qg.InvalidArgumentError, match="scan_step_a"):
        ssb.SSB(ds, voltage_kv=300, semiangle_mrad=25, scan_step_a=(0.5, -1))
    with pytest.raises(qg.ArgumentTypeError, match="compat_2alpha"):
        ssb.SSB(ds, voltage_kv=300, semiangle_mrad=25, scan_step_a=0.5, compat_2alpha="no")


def test_ssb_fit_counts(ds):
    s = ssb.SSB(ds, voltage_kv=300, semiangle_mrad=25, scan_step_a=0.5)
    with pytest.raises(qg.ArgumentTypeError, match="seed"):
        s.fit(seed=1.0)
    with pytest.raises(qg.InvalidArgumentError, match="local_starts"):
        s.fit(local_starts=0)
    with pytest.raises(qg.ArgumentTypeError, match="global_evals"):
        s.fit(global_evals=2.5)


def test_ssb_fit_on_a_1x1_scan_is_refused():
    one = io.load(np.arange(64, dtype=np.uint16).reshape(1, 1, 8, 8))
    # No BF disk in these frames: the sampling is given (else the calibration refuses first).
    s = ssb.SSB(one, voltage_kv=300, semiangle_mrad=25, scan_step_a=0.5, det_sampling_mrad=1.0)
    with pytest.raises(qg.InvalidArgumentError) as e:
        s.fit(seed=0, global_evals=2, local_max_iter=2)
    check(e, "2 x 2", "(1, 1)")
    with pytest.raises(qg.InvalidArgumentError, match="2 x 2"):
        s.objective({})
    # A 1 x N scan cannot constrain the row direction either.
    row = io.load(np.ones((1, 6, 8, 8), np.uint16))
    s = ssb.SSB(row, voltage_kv=300, semiangle_mrad=25, scan_step_a=0.5, det_sampling_mrad=1.0)
    with pytest.raises(qg.InvalidArgumentError, match=r"\(1, 6\)"):
        s.fit(seed=0, global_evals=2, local_max_iter=2)


def test_device_resolve_needs_a_name():
    from quantem.gpu import device

    with pytest.raises(qg.ArgumentTypeError, match="name"):
        device.resolve(None)
