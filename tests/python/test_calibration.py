"""``ds.calibration``: typed fields from the file's metadata (written by the independent
Dectris writer), settable by the user, and the user's values reaching the engine's calls
(detectors in mrad, DPC, SSB) as arguments that win over the file."""

from __future__ import annotations

import gc
import math
import pickle

import make_dectris
import numpy as np
import pytest
from disk_data import disk_data

import quantem.gpu as qg
from quantem.gpu import detector, dpc, io, ssb
from quantem.gpu.calibration import Calibration, electron_wavelength_a, from_metadata

# What the file says (the writer's own names and units).
FILE = {
    "energy_eV": 200e3,
    "semiangle_mrad": 21.0,
    "scan_step_A": 0.4,
    "angular_sampling_mrad": 1.25,
}


@pytest.fixture(scope="module")
def data():
    return disk_data(scan=(8, 9))


@pytest.fixture(scope="module")
def master(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calibrated")
    res = make_dectris.write_dectris(
        str(tmp / "cal"), data, frames_per_file=100, dtype=np.uint16, calib=FILE
    )
    return res["master"]


def test_metadata_values_and_sources(master):
    cal = io.load(master, backend="cpu").calibration
    assert cal.scan_step_a == (0.4, 0.4)
    assert cal.det_sampling_mrad == (1.25, 1.25)
    assert cal.voltage_kv == 200.0
    assert cal.semiangle_mrad == 21.0
    assert cal.rotation_deg is None
    assert cal.sources == {
        "scan_step_a": "metadata",
        "det_sampling_mrad": "metadata",
        "voltage_kv": "metadata",
        "semiangle_mrad": "metadata",
        "rotation_deg": "default",
    }
    assert "scan_step_a=(0.4, 0.4) Å [metadata]" in repr(cal)
    assert "(metadata)" in cal._repr_html_()


def test_dataset_table_shows_the_calibration(master):
    ds = io.load(master, backend="cpu")
    ds.calibration = ds.calibration.replace(rotation_deg=-3.0)
    h = ds._repr_html_()
    assert "calibration.scan_step_a</th><td style='text-align:left'>(0.4, 0.4) Å (metadata)" in h
    assert "calibration.rotation_deg</th><td style='text-align:left'>-3.0 ° (argument)" in h


def test_array_has_no_calibration(data):
    cal = io.load(data, backend="cpu").calibration
    assert all(cal.source(n) == "default" for n in qg.calibration.FIELDS)
    assert cal.scan_step_a is None and cal.voltage_kv is None


def test_detector_sampling_is_per_loaded_pixel(master):
    cal = io.load(master, backend="cpu", det_bin=2).calibration
    assert cal.det_sampling_mrad == (2.5, 2.5)


def test_voltage_from_the_wavelength_alone():
    # 300 kV electrons: 0.019687 Å (a textbook value).
    assert electron_wavelength_a(300.0) == pytest.approx(0.019687, abs=1e-6)
    cal = from_metadata({"wavelength_a": 0.0196875})
    assert cal.voltage_kv == pytest.approx(300.0, rel=1e-4)
    assert cal.source("voltage_kv") == "metadata"


def test_set_replace_and_reset(master):
    ds = io.load(master, backend="cpu")
    ds.calibration = ds.calibration.replace(scan_step_a=(0.5, 0.6), rotation_deg=-12)
    cal = ds.calibration
    assert cal.scan_step_a == (0.5, 0.6) and cal.rotation_deg == -12.0
    assert cal.source("scan_step_a") == "argument" and cal.source("rotation_deg") == "argument"
    assert cal.voltage_kv == 200.0 and cal.source("voltage_kv") == "metadata"
    # None goes back to the file's value.
    back = cal.replace(scan_step_a=None)
    assert back.scan_step_a == (0.4, 0.4) and back.source("scan_step_a") == "metadata"
    # A Calibration built by hand: its None fields take the file's values on the dataset.
    ds.calibration = Calibration(semiangle_mrad=30.0)
    assert ds.calibration.semiangle_mrad == 30.0 and ds.calibration.scan_step_a == (0.4, 0.4)
    assert ds.calibration.source("semiangle_mrad") == "argument"
    del ds.calibration
    assert ds.calibration.semiangle_mrad == 21.0
    assert ds.calibration.source("semiangle_mrad") == "metadata"
    # Another dataset of the same file is not touched.
    ds.calibration = ds.calibration.replace(voltage_kv=80)
    assert io.load(master, backend="cpu").calibration.voltage_kv == 200.0


@pytest.mark.parametrize(
    "field, value, error, found",
    [
        ("scan_step_a", -0.4, qg.InvalidArgumentError, "-0.4"),
        ("scan_step_a", (0.4, float("nan")), qg.InvalidArgumentError, "nan"),
        ("scan_step_a", "0.4", qg.ArgumentTypeError, "'0.4' (str)"),
        ("scan_step_a", (0.4, 0.4, 0.4), qg.InvalidArgumentError, "(0.4, 0.4, 0.4)"),
        ("det_sampling_mrad", 0.0, qg.InvalidArgumentError, "0.0"),
        ("voltage_kv", float("inf"), qg.InvalidArgumentError, "inf"),
        ("voltage_kv", True, qg.ArgumentTypeError, "True (bool)"),
        ("semiangle_mrad", -21.0, qg.InvalidArgumentError, "-21.0"),
        ("rotation_deg", float("nan"), qg.InvalidArgumentError, "nan"),
        ("rotation_deg", "12", qg.ArgumentTypeError, "'12' (str)"),
    ],
)
def test_bad_values_name_the_field(master, field, value, error, found):
    ds = io.load(master, backend="cpu")
    with pytest.raises(error, match=field) as e:
        ds.calibration = ds.calibration.replace(**{field: value})
    assert found in e.value.found
    with pytest.raises(error, match=field):
        Calibration(**{field: value})
    assert ds.calibration.source(field) != "argument"  # nothing was set


def test_wrong_kinds_of_assignment(master):
    ds = io.load(master, backend="cpu")
    with pytest.raises(qg.ArgumentTypeError, match="must be a Calibration"):
        ds.calibration = {"scan_step_a": 0.4}
    with pytest.raises(qg.ArgumentTypeError, match="unknown field 'step'"):
        ds.calibration.replace(step=0.4)
    with pytest.raises(qg.InvalidArgumentError, match="unknown calibration field"):
        ds.calibration.source("step")


def test_the_users_values_stay_through_the_calls(master):
    ds = io.load(master, backend="cpu")
    ds.calibration = ds.calibration.replace(scan_step_a=0.45)
    detector.products(ds, ["bf", "sum_dp", "com"])
    dpc.run(ds)
    ssb.SSB(ds, **ds.calibration.ssb_arguments())
    ds.to_numpy()
    ds[0:2, 1]
    assert ds.calibration.scan_step_a == (0.45, 0.45)
    assert ds.calibration.source("scan_step_a") == "argument"
    ds.close()
    assert ds.calibration.scan_step_a == (0.45, 0.45)


def test_a_later_dataset_never_inherits(data):
    ds = io.load(data, backend="cpu")
    ds.calibration = ds.calibration.replace(scan_step_a=9.0)
    del ds
    gc.collect()
    for _ in range(50):
        d = io.load(data, backend="cpu")
        assert d.calibration.source("scan_step_a") == "default"
        del d


def test_pickle_carries_the_users_values(master):
    ds = io.load(master, backend="cpu")
    ds.calibration = ds.calibration.replace(scan_step_a=0.45, rotation_deg=7.5)
    back = pickle.loads(pickle.dumps(ds))
    assert back.calibration.scan_step_a == (0.45, 0.45)
    assert back.calibration.rotation_deg == 7.5
    assert back.calibration.source("scan_step_a") == "argument"
    assert back.calibration.source("voltage_kv") == "metadata"


# ----------------------------------------------------------------------------- the calls


def test_ssb_receives_the_users_values(master):
    ds = io.load(master, backend="cpu")
    args = ds.calibration.ssb_arguments()
    assert args == {"voltage_kv": 200.0, "semiangle_mrad": 21.0, "scan_step_a": (0.4, 0.4)}
    s = ssb.SSB(ds, **args)
    assert s.info["det_sampling_mrad"] == 1.25  # the file's, read by the engine
    assert s.info["wavelength_a"] == pytest.approx(electron_wavelength_a(200.0), rel=1e-12)
    ds.calibration = ds.calibration.replace(
        voltage_kv=300, scan_step_a=0.55, det_sampling_mrad=1.5, rotation_deg=3.0
    )
    s = ssb.SSB(ds, **ds.calibration.ssb_arguments())
    p = s.info["params"]
    assert p["voltage_kv"] == 300.0 and p["scan_step_a"] == (0.55, 0.55)
    assert p["det_sampling_mrad"] == 1.5 and p["rotation_deg"] == 3.0
    assert s.info["det_sampling_mrad"] == 1.5
    assert s.info["wavelength_a"] == pytest.approx(0.019687, abs=1e-6)
    r = s.reconstruct()
    assert r.axes[0].scale == 0.55 and r.axes[0].units == "Å"


def test_ssb_takes_what_the_call_leaves_out_from_the_calibration(master, data):
    ds = io.load(master, backend="cpu")
    p = ssb.SSB(ds).info["params"]  # all from the file
    assert p["voltage_kv"] == 200.0 and p["semiangle_mrad"] == 21.0
    assert p["scan_step_a"] == (0.4, 0.4) and p["rotation_deg"] == 0.0
    ds.calibration = ds.calibration.replace(scan_step_a=0.55, rotation_deg=3.0)
    p = ssb.SSB(ds, voltage_kv=300.0).info["params"]  # the call wins, then the user's values
    assert p["voltage_kv"] == 300.0 and p["semiangle_mrad"] == 21.0
    assert p["scan_step_a"] == (0.55, 0.55) and p["rotation_deg"] == 3.0
    assert ssb.SSB(ds, rotation_deg=0.0).info["params"]["rotation_deg"] == 0.0
    # Without metadata nothing is guessed: the error says where the value may come from.
    bare = io.load(data, backend="cpu")
    with pytest.raises(qg.InvalidArgumentError, match="voltage_kv is required") as e:
        ssb.SSB(bare, semiangle_mrad=20.0, scan_step_a=0.5)
    assert "ds.calibration.voltage_kv" in e.value.expected


def test_ssb_arguments_refuse_an_unequal_detector_sampling(data):
    ds = io.load(data, backend="cpu")
    ds.calibration = Calibration(det_sampling_mrad=(1.0, 1.1))
    with pytest.raises(qg.InvalidArgumentError, match="det_sampling_mrad"):
        ds.calibration.ssb_arguments()


def test_detector_mrad_uses_the_users_sampling(master):
    ds = io.load(master, backend="cpu")
    img = detector.annular(ds, inner=5.0, outer=10.0, unit="mrad")
    assert img.inner_px == pytest.approx(5.0 / 1.25) and img.outer_px == pytest.approx(8.0)
    ds.calibration = ds.calibration.replace(det_sampling_mrad=2.5)
    img = detector.annular(ds, inner=5.0, outer=10.0, unit="mrad")
    assert img.inner_px == pytest.approx(2.0) and img.outer_px == pytest.approx(4.0)
    # An argument still wins over ds.calibration.
    img = detector.annular(ds, inner=5.0, outer=10.0, unit="mrad", det_sampling_mrad=5.0)
    assert img.outer_px == pytest.approx(2.0)


def test_detector_mrad_from_the_users_semiangle(data):
    ds = io.load(data, backend="cpu")
    with pytest.raises(qg.InvalidArgumentError):
        detector.bf(ds, outer=10.0, unit="mrad")
    ds.calibration = Calibration(semiangle_mrad=20.0)
    img = detector.bf(ds, outer=10.0, unit="mrad")
    want = detector.bf(ds, outer=10.0, unit="mrad", semiangle_mrad=20.0)
    assert img.outer_px == want.outer_px and np.array_equal(img.image, want.image)


def test_dpc_rotation_from_the_calibration(data):
    ds = io.load(data, backend="cpu")
    found = dpc.run(ds)
    ds.calibration = Calibration(rotation_deg=37.0)
    r = dpc.run(ds)
    assert r.rotation_deg == 37.0 and r.rotation_deg != found.rotation_deg
    want = dpc.run(ds, rotation_deg=37.0)
    assert np.array_equal(r.phase, want.phase)
    assert dpc.run(ds, rotation_deg=10.0).rotation_deg == 10.0  # the argument wins


def test_dpc_units_match_the_engines_own_calibration(data, master):
    """The same counts: from the calibrated file (the engine reads the metadata) and from an
    array with the same values set by the user (applied to the engine's pixel result)."""
    ref = dpc.run(io.load(master, backend="cpu"))
    assert ref.units["phase"] == "rad" and ref.units["com_row"] == "mrad"
    ds = io.load(data, backend="cpu")
    ds.calibration = Calibration(voltage_kv=200.0, scan_step_a=0.4, det_sampling_mrad=1.25)
    got = dpc.run(ds)
    assert got.units == ref.units
    assert got.rotation_deg == pytest.approx(ref.rotation_deg, rel=1e-12)
    assert got.transpose == ref.transpose
    for n in ("com_row", "com_col", "dpc_row", "dpc_col"):
        np.testing.assert_allclose(getattr(got, n), getattr(ref, n), rtol=1e-12, atol=0)
    # The file stores the wavelength as float32: the engine's λ differs from 200 kV's by ~1e-8.
    np.testing.assert_allclose(got.phase, ref.phase, rtol=1e-6, atol=1e-9 * np.abs(ref.phase).max())
    assert got.curl_score == pytest.approx(ref.curl_score, rel=1e-9)
    assert got.axes[0].scale == 0.4 and got.axes[0].units == "Å"
    assert got.provenance["calibration_applied"]["field_factor"] == 1.25
    com = dpc.center_of_mass(ds)
    np.testing.assert_allclose(com.com_row, dpc.center_of_mass(io.load(master)).com_row, rtol=1e-12)
    assert com.unit == "mrad"


def test_dpc_user_sampling_over_the_files(master):
    ds = io.load(master, backend="cpu")
    ref = dpc.run(ds)
    ds.calibration = ds.calibration.replace(det_sampling_mrad=2.5)  # twice the file's
    got = dpc.run(ds)
    np.testing.assert_allclose(got.com_row, 2.0 * ref.com_row, rtol=1e-12)
    np.testing.assert_allclose(got.phase, 2.0 * ref.phase, rtol=1e-12, atol=1e-15)
    ds.calibration = ds.calibration.replace(det_sampling_mrad=None, voltage_kv=300.0)
    got = dpc.run(ds)
    lam = ref.provenance["params"]["calibration"]["wavelength_a"]
    factor = lam / electron_wavelength_a(300.0)  # phase ∝ 1/λ
    np.testing.assert_allclose(got.phase, factor * ref.phase, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(got.com_row, ref.com_row)
    assert math.isclose(got.provenance["calibration_applied"]["phase_factor"], factor)


def test_dpc_refuses_an_unequal_step_change(data):
    ds = io.load(data, backend="cpu")
    ds.calibration = Calibration(voltage_kv=200.0, scan_step_a=(0.4, 0.5), det_sampling_mrad=1.0)
    with pytest.raises(qg.InvalidArgumentError, match="scan_step_a"):
        dpc.run(ds)
    # Without a voltage the phase stays in mrad·scan step: nothing to refuse.
    ds.calibration = Calibration(scan_step_a=(0.4, 0.5), det_sampling_mrad=1.0)
    r = dpc.run(ds)
    assert r.units["phase"] == "mrad·scan step" and r.axes[1].scale == 0.5
