"""Result axes and units, saving (TIFF, EMD/HDF5) read back by other libraries, scale bars, and
the native module's type stubs.

Expected values come from NumPy (the sums), from the calibration the demo acquisition records
(0.4 Å scan step, written by qem-sim), and from tifffile, h5py, emdfile and rosettasciio reading
the files back; never from the writer under test.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import console_script

import quantem.gpu as qg
from quantem.gpu import _native, detector, dpc, io, ssb
from quantem.gpu.results import Axis, add_scale_bar, nice_scale_bar

STUB = Path(qg.__file__).with_name("_native.pyi")


@pytest.fixture(scope="module")
def demo_master(tmp_path_factory) -> Path:
    """The demo acquisition (48 x 40 scan, 64 x 64 frames, 0.4 Å step), written by the CLI."""
    exe = console_script()
    assert exe is not None, "the quantem-gpu console script is installed with the wheel"
    out = tmp_path_factory.mktemp("demo")
    subprocess.run([exe, "demo", "--out", str(out)], check=True, capture_output=True)
    master = out / "demo_master.h5"
    assert master.is_file()
    return master


@pytest.fixture(scope="module")
def demo(demo_master):
    with io.load(demo_master, backend="cpu") as ds:
        yield ds


@pytest.fixture
def plain():
    """A 6 x 7 scan of 16 x 16 frames with a bright disk, from NumPy: no calibration."""
    rng = np.random.default_rng(3)
    rr, cc = np.mgrid[:16, :16]
    disk = ((rr - 7.5) ** 2 + (cc - 8.0) ** 2 <= 16).astype(float)
    a = rng.poisson(40.0 * disk + 1.0, size=(6, 7, 16, 16)).astype(np.uint16)
    with io.load(a, backend="cpu") as ds:
        yield ds, a


# --- axes and units ------------------------------------------------------------------------


def test_uncalibrated_results_have_pixel_axes(plain):
    ds, a = plain
    bf = detector.bf(ds)
    assert bf.axes == (Axis("R_r", 6, 1.0, "px"), Axis("R_c", 7, 1.0, "px"))
    assert bf.units == {"image": "counts"}
    p = detector.products(ds, ["adf", "sum_dp", "mean_dp", "com", "moments"])
    assert p.axes["sum_dp"] == (Axis("k_r", 16, 1.0, "px"), Axis("k_c", 16, 1.0, "px"))
    assert p.axes["adf"] == bf.axes and p.axes["com"] == bf.axes
    assert p.units["sum_dp"] == "counts" and p.units["com"] == "px"
    # The values are what they were: the exact sums.
    assert np.array_equal(p["sum_dp"], a.astype(np.uint64).sum(axis=(0, 1)))
    com = dpc.center_of_mass(ds)
    assert com.axes == bf.axes and com.units == {"com_row": "px", "com_col": "px"}
    r = dpc.run(ds)
    assert r.axes == bf.axes
    assert r.units["com_row"] == "px" and r.units["phase"] != "rad"


def test_scan_axes_in_angstrom_from_the_metadata(demo):
    step = demo.metadata["scan_step_a"]
    assert tuple(step) == (0.4, 0.4)  # what qem-sim writes into the demo's master file
    bf = detector.bf(demo)
    assert bf.axes == (Axis("R_r", 48, 0.4, "Å"), Axis("R_c", 40, 0.4, "Å"))
    assert np.allclose(bf.axes[1].values(), 0.4 * np.arange(40))
    # The detector sampling given to the call puts the detector axes in mrad.
    p = detector.products(demo, ["sum_dp", "bf"], det_sampling_mrad=0.75)
    assert p.axes["sum_dp"] == (Axis("k_r", 64, 0.75, "mrad"), Axis("k_c", 64, 0.75, "mrad"))
    assert p.axes["bf"] == bf.axes
    assert dpc.run(demo).axes == bf.axes


def test_ssb_axes_from_its_scan_step(demo_master):
    with io.load(demo_master, backend="cpu", det_bin=2) as ds:
        s = ssb.SSB(ds, voltage_kv=300, semiangle_mrad=20, scan_step_a=(0.5, 0.25))
        r = s.reconstruct({"C10": 50.0})
    assert r.axes == (Axis("R_r", 48, 0.5, "Å"), Axis("R_c", 40, 0.25, "Å"))
    assert r.units["phase"] == "rad" and r.units["weak_phase"] == "rad"


# --- TIFF ----------------------------------------------------------------------------------


def test_tiff_has_the_calibration_and_the_values(demo, tmp_path):
    tifffile = pytest.importorskip("tifffile")
    bf = detector.bf(demo)
    path = bf.save(tmp_path / "bf.tif")
    assert path == str(tmp_path / "bf.tif")
    with tifffile.TiffFile(path) as t:
        data = t.asarray()
        ij = t.imagej_metadata
        tags = t.pages[0].tags
        xres, yres = tags["XResolution"].value, tags["YResolution"].value
    assert bf.image.max() <= 65535
    assert data.dtype == np.uint16 and np.array_equal(data, bf.image)
    # 0.4 Å = 0.04 nm per pixel: 25 pixels per nm on both axes, ImageJ unit nm.
    assert ij["unit"] == "nm"
    assert xres[0] / xres[1] == pytest.approx(25.0) and yres[0] / yres[1] == pytest.approx(25.0)


def test_tiff_read_by_rosettasciio(demo, tmp_path):
    rsciio_tiff = pytest.importorskip("rsciio.tiff")
    r = dpc.run(demo)
    r.save(tmp_path / "phase.tiff")
    (sig,) = rsciio_tiff.file_reader(str(tmp_path / "phase.tiff"))
    assert sig["data"].dtype == np.float32
    assert np.allclose(sig["data"], r.phase, rtol=1e-6, atol=1e-6 * np.abs(r.phase).max())
    scales = [ax["scale"] for ax in sig["axes"]]
    assert scales == pytest.approx([0.04, 0.04])  # nm


def test_tiff_without_calibration_has_no_unit(plain, tmp_path):
    tifffile = pytest.importorskip("tifffile")
    ds, _ = plain
    bf = detector.bf(ds)
    bf.save(tmp_path / "bf.tif")
    with tifffile.TiffFile(tmp_path / "bf.tif") as t:
        assert "unit" not in (t.imagej_metadata or {})
        assert np.array_equal(t.asarray(), bf.image)


def test_tiff_of_sums_on_mrad_axes(demo, tmp_path):
    tifffile = pytest.importorskip("tifffile")
    sampling = demo.metadata["angular_sampling_mrad"]
    assert sampling is not None  # the demo's master file records it
    p = detector.products(demo, ["sum_dp", "bf"])
    assert p.axes["sum_dp"][1] == Axis("k_c", 64, float(sampling[1]), "mrad")
    p.save(tmp_path / "sum.tif", which="sum_dp")
    with tifffile.TiffFile(tmp_path / "sum.tif") as t:
        back = t.asarray()
        assert t.imagej_metadata["unit"] == "mrad"
        xres = t.pages[0].tags["XResolution"].value
    # Sums that fit stay uint16; above 65535 they are written as float32 (exact up to 2**24).
    big = p["sum_dp"].max() > 65535
    assert p["sum_dp"].max() < 2**24 and back.dtype == (np.float32 if big else np.uint16)
    assert np.array_equal(back.astype(np.uint64), p["sum_dp"])
    assert xres[0] / xres[1] == pytest.approx(1.0 / float(sampling[1]), rel=1e-4)


def test_save_refuses_what_it_cannot_write(plain, tmp_path):
    ds, _ = plain
    p = detector.products(ds, ["bf", "adf"])
    with pytest.raises(qg.InvalidArgumentError, match="which="):
        p.save(tmp_path / "two.tif")
    with pytest.raises(qg.InvalidArgumentError, match="which= names no image"):
        p.save(tmp_path / "x.tif", which="haadf")
    with pytest.raises(qg.InvalidArgumentError, match=r"\.tif"):
        detector.bf(ds).save(tmp_path / "bf.jpg")
    with pytest.raises(qg.ArgumentTypeError):
        detector.bf(ds).save(3.5)
    assert not list(tmp_path.iterdir())


# --- EMD / HDF5 ----------------------------------------------------------------------------


def test_emd_layout_follows_the_emd_1_0_spec(demo, tmp_path):
    p = detector.products(demo, ["bf", "sum_dp", "moments"], det_sampling_mrad=0.75)
    p.save(tmp_path / "p.h5")
    with h5py.File(tmp_path / "p.h5", "r") as f:
        assert f.attrs["emd_group_type"] == "file"
        assert (int(f.attrs["version_major"]), int(f.attrs["version_minor"])) == (1, 0)
        (root_name,) = [k for k in f if f[k].attrs.get("emd_group_type") == "root"]
        root = f[root_name]
        arrays = {k: root[k] for k in root if root[k].attrs.get("emd_group_type") == "array"}
        assert set(arrays) == {"bf", "sum_dp", "moments_sum", "moments_m_row", "moments_m_col"}
        bf = arrays["bf"]
        assert bf["data"].dtype == np.uint64 and np.array_equal(bf["data"][()], p["bf"].image)
        assert bf["data"].attrs["units"] == "counts"
        assert list(bf["dim0"][()]) == [0.0, 0.4] and bf["dim0"].attrs["units"] == "A"
        assert bf["dim1"].attrs["name"] == "R_c"
        sdp = arrays["sum_dp"]
        assert list(sdp["dim1"][()]) == [0.0, 0.75] and sdp["dim1"].attrs["units"] == "mrad"
        md = root["metadatabundle"]["quantem"]
        assert md.attrs["emd_group_type"] == "metadata"
        assert md["disk.radius_px"][()] == pytest.approx(p.disk.radius_px)
        assert "detector.products" in md["provenance"][()].decode()


def test_emd_read_by_emdfile(demo, tmp_path):
    emdfile = pytest.importorskip("emdfile")
    r = dpc.run(demo)
    r.save(tmp_path / "dpc.emd")
    root = emdfile.read(str(tmp_path / "dpc.emd"))
    phase = root.tree("phase")
    assert np.array_equal(phase.data, r.phase)
    assert phase.dim_units[0] == "A" and phase.dims[1][1] == pytest.approx(0.4)
    assert np.array_equal(root.tree("com_row").data, r.com_row)


def test_emd_read_by_rosettasciio(demo, tmp_path):
    rsciio_emd = pytest.importorskip("rsciio.emd")
    bf = detector.bf(demo)
    bf.save(tmp_path / "bf.emd")
    (sig,) = rsciio_emd.file_reader(str(tmp_path / "bf.emd"))
    assert np.array_equal(sig["data"], bf.image)
    assert [ax["scale"] for ax in sig["axes"]] == pytest.approx([0.4, 0.4])
    assert [ax["units"] for ax in sig["axes"]] == ["Å", "Å"]
    assert [ax["size"] for ax in sig["axes"]] == [48, 40]


def test_ssb_fit_saves_object_and_loss_curve(demo_master, tmp_path):
    emdfile = pytest.importorskip("emdfile")
    with io.load(demo_master, backend="cpu", det_bin=2) as ds:
        s = ssb.SSB(ds, voltage_kv=300, semiangle_mrad=20, scan_step_a=0.4)
        f = s.fit(seed=0, fit=["C10"], global_evals=4, local_max_iter=5, local_starts=1)
    assert f.axes == f.result.axes and f.units["C10"] == "Å"  # aberration units stay
    f.save(tmp_path / "fit.h5")
    root = emdfile.read(str(tmp_path / "fit.h5"))
    assert np.array_equal(root.tree("object").data, f.result.object)
    assert np.array_equal(root.tree("loss_curve").data, f.loss_curve)
    with h5py.File(tmp_path / "fit.h5", "r") as h:
        assert h["quantem/metadatabundle/quantem/loss"][()] == pytest.approx(f.loss)


# --- scale bars ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scale, units, n, expected",
    [
        (0.25, "Å", 64, (2.0, 8.0, "2 Å")),  # a fifth of 16 Å is 3.2 Å
        (0.5, "Å", 256, (20.0, 40.0, "2 nm")),  # from 10 Å on, in nm
        (1.0, "px", 48, (5.0, 5.0, "5 px")),
        (0.9, "mrad", 64, (10.0, 10.0 / 0.9, "10 mrad")),
        (3.0, "Å", 2, (2.0, 2.0 / 3.0, "2 Å")),  # at most one sample: 2 Å of a 3 Å step
    ],
)
def test_nice_scale_bar(scale, units, n, expected):
    length, px, label = nice_scale_bar(scale, units, n)
    assert (length, px, label) == (
        pytest.approx(expected[0]),
        pytest.approx(expected[1]),
        expected[2],
    )


def test_add_scale_bar_on_a_matplotlib_image():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.imshow(np.zeros((64, 80)))
    bar = add_scale_bar(ax, Axis("R_c", 80, 0.25, "Å"))
    # A fifth of 20 Å is 4 Å; the largest 1/2/5 x 10^n within it is 2 Å = 8 samples.
    assert bar in ax.artists
    texts = [t.get_text() for t in bar.findobj(matplotlib.text.Text)]
    assert "2 Å" in texts
    rect = [r for r in bar.findobj(matplotlib.patches.Rectangle) if r.get_width() > 0]
    assert any(r.get_width() == pytest.approx(8.0) for r in rect)
    plt.close(fig)


def test_nice_scale_bar_refuses_a_bad_axis():
    with pytest.raises(qg.InvalidArgumentError):
        nice_scale_bar(0.0, "Å", 10)


# --- typing --------------------------------------------------------------------------------


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(encoding="utf-8"))


def test_stub_names_every_public_native_name():
    tree = _stub_tree()
    named = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in tree.body if isinstance(n, ast.AnnAssign) for t in [n.target]
    }
    native = {n for n in dir(_native) if not n.startswith("__") or n == "__version__"}
    missing = sorted(native - named)
    assert not missing, f"_native.pyi lacks {missing}"
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name in ("Dataset",):
            members = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            public = {m for m in dir(_native.Dataset) if not m.startswith("_")}
            assert not sorted(public - members), f"Dataset stub lacks {sorted(public - members)}"


def test_stub_parameters_match_the_native_signatures():
    tree = _stub_tree()
    checked = 0
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        fn = getattr(_native, node.name)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        a = node.args
        stub = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        if a.vararg:
            stub.append(a.vararg.arg)
        assert list(sig.parameters) == stub, f"{node.name}: {list(sig.parameters)} vs {stub}"
        checked += 1
    assert checked >= 15


USAGE = """
    import numpy as np
    from quantem.gpu import io, detector, dpc
    from quantem.gpu.results import Axis

    ds = io.load(np.zeros((2, 2, 4, 4), dtype=np.uint16), backend="cpu")
    shape: tuple[int, int, int, int] = ds.shape
    nbytes: int = ds.nbytes_resident
    img = detector.bf(ds)
    ax: Axis = img.axes[0]
    scale: float = ax.scale
    r = dpc.run(ds)
    rot: float = r.rotation_deg
"""


def _mypy(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy")
    script = tmp_path / "usage.py"
    script.write_text(textwrap.dedent(text), encoding="utf-8")
    env = dict(os.environ, MYPYPATH="")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "c"),
            "--python-version",
            "3.10",
            str(script),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def test_mypy_accepts_typed_usage_and_rejects_a_wrong_call(tmp_path):
    ok = _mypy(tmp_path, USAGE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _mypy(tmp_path, USAGE + "    wrong: str = ds.nbytes_resident\n")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "nbytes_resident" in bad.stdout or "incompatible types" in bad.stdout.lower()
