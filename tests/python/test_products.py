"""Detector products (``quantem.gpu.detector``) against NumPy float64/uint64 implementations.

Every expected value is computed here from the counts as h5py (or the test itself) sees them:
sums and images with ``np.uint64`` arithmetic, the disk fit and masks in float64 following
docs/science.md §3–4 (threshold mean + population std, strict ``>``, unweighted centroid,
equal-area radius; ``lo² ≤ |k − c|² ≤ hi²``). Integer results must be byte-exact.

Cases: a Dectris u32 acquisition with bad pixels (rectangular 5x7 scan, odd 11x13 detector),
the same as u16 held ENCODED, 2x2 detector binning with partial edge blocks, a numpy source
with all-zero frames, and u32 counts near 2^32 (sums that need 64 bits).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (
    DET,
    SCAN,
    bin_reference,
    h5py_dectris,
    mask_array,
    masked,
    write_acquisition,
)

import quantem.gpu as qg
from quantem.gpu import detector, device, dpc, io, ssb

# ----------------------------------------------------------------------------- references


def disk_counts(scan, det, center, radius, seed, inside=40.0, outside=2.0, dtype=np.uint32):
    """Poisson frames with a bright disk: a mean DP the BF fit can find."""
    rng = np.random.default_rng(seed)
    i, j = np.mgrid[: det[0], : det[1]].astype(np.float64)
    inside_disk = (i - center[0]) ** 2 + (j - center[1]) ** 2 <= radius**2
    lam = np.where(inside_disk, inside, outside)
    return rng.poisson(lam, size=tuple(scan) + tuple(det)).astype(dtype)


def ref_sum_dp(a):
    return a.astype(np.uint64).sum(axis=(0, 1), dtype=np.uint64)


def ref_mean_dp(a):
    n = a.shape[0] * a.shape[1]
    return (ref_sum_dp(a).astype(np.float64) / n).astype(np.float32)


def ref_fit_disk(a):
    """(center, radius, threshold, n_pixels) from the float32 mean DP, in float64."""
    kr, kc = a.shape[-2:]
    m = ref_mean_dp(a).astype(np.float64)
    t = m.mean() + m.std()
    sel = m > t
    n = int(sel.sum())
    if n == 0:
        return (kr / 2, kc / 2), min(kr, kc) / 4, t, 0
    i, j = np.nonzero(sel)
    return (float(i.mean()), float(j.mean())), math.sqrt(n / math.pi), t, n


def ring(det, center, lo, hi):
    i, j = np.mgrid[: det[0], : det[1]].astype(np.float64)
    d2 = (i - center[0]) ** 2 + (j - center[1]) ** 2
    return (lo * lo <= d2) & (d2 <= hi * hi)


def ref_virtual(a, weights):
    w = np.asarray(weights)
    if w.dtype.kind == "f":
        return (a.astype(np.float64) * w).sum(axis=(2, 3))
    return (a.astype(np.uint64) * w.astype(np.uint64)).sum(axis=(2, 3), dtype=np.uint64)


def ref_moments(a):
    kr, kc = a.shape[-2:]
    a64 = a.astype(np.uint64)
    rows = np.arange(kr, dtype=np.uint64)[:, None]
    cols = np.arange(kc, dtype=np.uint64)[None, :]
    return {
        "sum": a64.sum(axis=(2, 3), dtype=np.uint64),
        "m_row": (a64 * rows).sum(axis=(2, 3), dtype=np.uint64),
        "m_col": (a64 * cols).sum(axis=(2, 3), dtype=np.uint64),
    }


def ref_com(a, centered=True):
    m = ref_moments(a)
    s = m["sum"].astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    mr = np.where(s > 0, m["m_row"].astype(np.float64) / safe, 0.0)
    mc = np.where(s > 0, m["m_col"].astype(np.float64) / safe, 0.0)
    if centered:
        mr, mc = mr - mr.mean(), mc - mc.mean()
    return mr, mc, int((m["sum"] == 0).sum())


#: (lo, hi) of each detector in units of the BF radius r (docs/science.md §4).
BOUNDS = {
    "bf": (0.0, 1.0),
    "abf": (0.5, 1.0),
    "adf": (1.0, 2.0),
    "haadf": (2.0, 4.0),
    "df": (1.0, math.inf),
}

# ----------------------------------------------------------------------------- cases

DISK_CENTER, DISK_RADIUS = (5.3, 6.1), 3.2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Dectris acquisitions with a bright disk and bad pixels: u32 and u16."""
    tmp = tmp_path_factory.mktemp("products")
    out = {}
    for name, dtype, seed in [("u32", np.uint32, 11), ("u16", np.uint16, 12)]:
        data = disk_counts(SCAN, DET, DISK_CENTER, DISK_RADIUS, seed, dtype=dtype)
        master, _, _ = write_acquisition(
            tmp, name=f"disk_{name}", data=data, dtype=dtype, pixel_mask=mask_array()
        )
        raw = h5py_dectris(master).reshape(SCAN + DET)
        np.testing.assert_array_equal(raw, data)
        out[name] = (master, masked(raw))
    return out


def _zero_frames():
    a = disk_counts((4, 6), (9, 9), (4.0, 4.5), 2.5, seed=5, dtype=np.uint16)
    a[0, :3] = 0
    a[2, 4] = 0
    return a


def _big_u32():
    rng = np.random.default_rng(9)
    hi = np.iinfo(np.uint32).max
    return rng.integers(hi - 1000, hi, size=(3, 4, 7, 5), endpoint=True, dtype=np.uint32)


CASES = [
    "dectris_u32",
    "dectris_u16_encoded",
    "det_bin2",
    "zero_frames",
    "zero_frames_encoded",
    "big_u32",
]


@pytest.fixture(params=CASES)
def case(request, files):
    """(dataset, the counts it must hold as a numpy array)."""
    name = request.param
    if name == "dectris_u32":
        master, ref = files["u32"]
        ds = io.load(master, backend="cpu")
    elif name == "dectris_u16_encoded":
        master, ref = files["u16"]
        ds = io.load(master, backend="cpu", representation="encoded")
        assert ds.representation is io.DataRepresentation.ENCODED
    elif name == "det_bin2":
        master, masked = files["u32"]
        ref = bin_reference(masked, 2)
        ds = io.load(master, backend="cpu", det_bin=2)
    elif name == "zero_frames":
        ref = _zero_frames()
        ds = io.load(ref, backend="cpu")
    elif name == "zero_frames_encoded":
        ref = _zero_frames()
        ds = io.load(ref, backend="cpu", representation="encoded")
    else:
        ref = _big_u32()
        ds = io.load(ref, backend="cpu")
    assert ds.shape == ref.shape
    np.testing.assert_array_equal(ds.to_numpy().astype(np.uint64), ref.astype(np.uint64))
    yield ds, ref
    ds.close()


def _assert_exact(got, want, dtype):
    assert got.dtype == dtype, (got.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(got, want.astype(dtype))


# ----------------------------------------------------------------------------- diffraction sums


def test_diffraction_patterns(case):
    ds, a = case
    _assert_exact(detector.sum_dp(ds), ref_sum_dp(a), np.uint64)
    m = detector.mean_dp(ds)
    assert m.dtype == np.float32 and m.shape == a.shape[2:]
    np.testing.assert_array_equal(m, ref_mean_dp(a))
    _assert_exact(detector.max_dp(ds), a.max(axis=(0, 1)).astype(np.uint32), np.uint32)


def test_frames(case):
    ds, a = case
    rows, cols = a.shape[:2]
    pos = [(0, 0), (rows - 1, cols - 1), (rows // 2, 1), (0, 0)]
    got = detector.frames(ds, pos)
    assert got.shape == (len(pos),) + a.shape[2:]
    assert got.dtype == ds.dtype
    np.testing.assert_array_equal(got, np.stack([a[r, c] for r, c in pos]).astype(ds.dtype))


def test_roi_dp_rect_circle_positions(case):
    ds, a = case
    rows, cols = a.shape[:2]
    rect = (1, rows, 0, max(1, cols - 2))
    sel = a[rect[0] : rect[1], rect[2] : rect[3]].reshape(-1, *a.shape[2:])
    _assert_exact(
        detector.roi_dp(ds, rect=rect), sel.astype(np.uint64).sum(0, dtype=np.uint64), np.uint64
    )
    _assert_exact(detector.roi_dp(ds, rect=rect, reduce="max"), sel.max(0), np.uint32)
    mean = detector.roi_dp(ds, rect=rect, reduce="mean")
    want = (sel.astype(np.uint64).sum(0).astype(np.float64) / sel.shape[0]).astype(np.float32)
    assert mean.dtype == np.float32
    np.testing.assert_array_equal(mean, want)

    # A circle of scan positions: (r - r0)^2 + (c - c0)^2 <= R^2, boundary included.
    r0, c0, rad = (rows - 1) / 2, (cols - 1) / 2, 1.5
    rr, cc = np.mgrid[:rows, :cols]
    inside = (rr - r0) ** 2 + (cc - c0) ** 2 <= rad**2
    sel = a[inside]
    _assert_exact(
        detector.roi_dp(ds, circle=(r0, c0, rad)),
        sel.astype(np.uint64).sum(0, dtype=np.uint64),
        np.uint64,
    )
    # A circle whose boundary passes exactly through scan positions (radius 1 around a position).
    inside = (rr - 1) ** 2 + (cc - 1) ** 2 <= 1
    _assert_exact(
        detector.roi_dp(ds, circle=(1, 1, 1.0)),
        a[inside].astype(np.uint64).sum(0, dtype=np.uint64),
        np.uint64,
    )

    pos = [(rows - 1, 0), (0, cols - 1), (0, 0)]
    sel = np.stack([a[r, c] for r, c in pos])
    _assert_exact(
        detector.roi_dp(ds, positions=pos), sel.astype(np.uint64).sum(0, dtype=np.uint64), np.uint64
    )
    _assert_exact(detector.roi_dp(ds, positions=pos, reduce="max"), sel.max(0), np.uint32)


# ----------------------------------------------------------------------------- virtual images


def test_virtual_image_bool_int_float_masks(case):
    ds, a = case
    det = a.shape[2:]
    rng = np.random.default_rng(3)
    m = rng.random(det) < 0.4
    # Touch every edge of the detector.
    m[0, :] = m[-1, :] = True
    m[:, 0] = m[:, -1] = True
    img = detector.virtual_image(ds, m)
    _assert_exact(img, ref_virtual(a, m), np.uint64)
    assert img.shape == a.shape[:2]

    w = rng.integers(0, 65535, size=det, endpoint=True).astype(np.int32)
    _assert_exact(detector.virtual_image(ds, w), ref_virtual(a, w), np.uint64)
    w16 = w.astype(np.uint16)
    _assert_exact(detector.virtual_image(ds, w16), ref_virtual(a, w16), np.uint64)

    f = rng.normal(size=det)
    got = detector.virtual_image(ds, f)
    assert got.dtype == np.float64 and got.shape == a.shape[:2]
    want = ref_virtual(a, f)
    scale = np.abs(a.astype(np.float64)).sum(axis=(2, 3)) * np.abs(f).max() + 1.0
    assert np.all(np.abs(got - want) <= 1e-12 * scale)

    # All-zero and all-one masks.
    _assert_exact(
        detector.virtual_image(ds, np.zeros(det, bool)), np.zeros(a.shape[:2], np.uint64), np.uint64
    )
    _assert_exact(
        detector.virtual_image(ds, np.ones(det, bool)),
        a.astype(np.uint64).sum(axis=(2, 3), dtype=np.uint64),
        np.uint64,
    )


def test_disk_fit_and_default_detectors(case):
    ds, a = case
    det = a.shape[2:]
    center, radius, threshold, n = ref_fit_disk(a)
    fit = detector.fit_disk(ds)
    assert fit.fitted
    assert fit.n_pixels == n
    np.testing.assert_allclose(fit.center_px, center, rtol=0, atol=1e-9)
    assert fit.radius_px == pytest.approx(radius, abs=1e-9)
    assert fit.threshold == pytest.approx(threshold, rel=1e-9)
    for kind, (lo, hi) in BOUNDS.items():
        res = getattr(detector, kind)(ds)
        mask = ring(det, center, lo * radius, hi * radius)
        _assert_exact(res.image, ref_virtual(a, mask), np.uint64)
        assert res.kind == kind
        assert res.mask_pixels == int(mask.sum())
        assert res.inner_px == pytest.approx(lo * radius, abs=1e-9)
        assert res.outer_px == pytest.approx(hi * radius, abs=1e-9)
        np.testing.assert_allclose(res.center, center, atol=1e-9)
        assert res.radius == pytest.approx(radius, abs=1e-9)
        assert isinstance(res.provenance, dict) and res.provenance
        np.testing.assert_array_equal(np.asarray(res), res.image)
        assert kind in repr(res)


def test_the_fit_finds_the_simulated_disk(files):
    master, a = files["u32"]
    with io.load(master, backend="cpu") as ds:
        fit = detector.fit_disk(ds)
    assert abs(fit.center_px[0] - DISK_CENTER[0]) < 0.5
    assert abs(fit.center_px[1] - DISK_CENTER[1]) < 0.5
    assert abs(fit.radius_px - DISK_RADIUS) < 0.6


def test_explicit_center_radius_and_bounds(case):
    ds, a = case
    det = a.shape[2:]
    # A disk in the corner: the mask touches two detector edges.
    res = detector.bf(ds, center=(0.0, 0.0), radius=4.0)
    mask = ring(det, (0.0, 0.0), 0.0, 4.0)  # includes the pixels at distance exactly 4
    _assert_exact(res.image, ref_virtual(a, mask), np.uint64)
    assert res.center == (0.0, 0.0) and res.radius == 4.0
    assert not res.disk.fitted
    # Explicit inner/outer in pixels around the fitted centre.
    center, _, _, _ = ref_fit_disk(a)
    res = detector.adf(ds, inner=1.0, outer=3.0)
    _assert_exact(res.image, ref_virtual(a, ring(det, center, 1.0, 3.0)), np.uint64)
    assert (res.inner_px, res.outer_px) == (1.0, 3.0)
    res = detector.annular(ds, inner=2.0, outer=2.5, center=(det[0] / 2, det[1] / 2), radius=3.0)
    _assert_exact(
        res.image, ref_virtual(a, ring(det, (det[0] / 2, det[1] / 2), 2.0, 2.5)), np.uint64
    )
    # Radius only: defaults scale with it (ADF [r, 2r]).
    res = detector.adf(ds, radius=2.0, center=(4.0, 4.0))
    _assert_exact(res.image, ref_virtual(a, ring(det, (4.0, 4.0), 2.0, 4.0)), np.uint64)


def test_mrad_units(case):
    ds, a = case
    det = a.shape[2:]
    center = (4.0, 3.5)
    # 0.5 mrad per pixel: 1 mrad = 2 px.
    res = detector.adf(ds, inner=1.0, outer=2.5, center=center, unit="mrad", det_sampling_mrad=0.5)
    _assert_exact(res.image, ref_virtual(a, ring(det, center, 2.0, 5.0)), np.uint64)
    assert (res.inner_px, res.outer_px) == pytest.approx((2.0, 5.0))
    # Without the sampling: the semi-angle over the BF disk *edge*, alpha mrad = r_edge px — the
    # one calibration rule, so the sampling is the one SSB takes from the same data (not the
    # masks' threshold radius). A disk too small for an edge (binned 2x: r ~ 1.7 px) falls back
    # to the threshold radius.
    alpha = 20.0
    _, threshold_radius, _, _ = ref_fit_disk(a)
    res = detector.adf(ds, inner=10.0, outer=20.0, center=center, unit="mrad", semiangle_mrad=alpha)
    source = res.provenance["params"]["calibration"]["sampling_source"]

    def prepare():
        return ssb.SSB(ds, voltage_kv=300, semiangle_mrad=alpha, scan_step_a=1.0)

    # The property: the detector takes SSB's sampling wherever SSB can measure the edge, and
    # the threshold radius, saying so, exactly where SSB refuses the disk as too small.
    try:
        edge = alpha / prepare().info["det_sampling_mrad"]
    except qg.InvalidArgumentError as e:
        assert "too small to measure its edge" in str(e), e
        edge = threshold_radius
        assert "threshold disk radius" in source and "no disk edge" in source, source
    else:
        assert abs(edge - threshold_radius) > 0.01, (edge, threshold_radius)
        assert "BF disk edge radius" in source, source
    lo, hi = 0.5 * edge, 1.0 * edge
    _assert_exact(res.image, ref_virtual(a, ring(det, center, lo, hi)), np.uint64)
    assert (res.inner_px, res.outer_px) == pytest.approx((lo, hi), abs=1e-9)


def test_moments_and_com(case):
    ds, a = case
    m = detector.moments(ds)
    want = ref_moments(a)
    assert set(m) == {"sum", "m_row", "m_col"}
    for k in want:
        _assert_exact(m[k], want[k], np.uint64)
    for centered in (True, False):
        com = dpc.center_of_mass(ds, centered=centered)
        mr, mc, zeros = ref_com(a, centered)
        assert com.com_row.dtype == np.float64 and com.com_row.shape == a.shape[:2]
        np.testing.assert_allclose(com.com_row, mr, rtol=0, atol=1e-9)
        np.testing.assert_allclose(com.com_col, mc, rtol=0, atol=1e-9)
        assert com.zero_frames == zeros
        assert com.centered is centered
        assert com.unit == "px"


def test_products_is_one_pass_equal_to_single_calls(case):
    ds, a = case
    names = ["bf", "abf", "adf", "haadf", "df", "sum_dp", "mean_dp", "max_dp", "moments", "com"]
    out = detector.products(ds, names)
    assert list(out) == names
    center, radius, _, _ = ref_fit_disk(a)
    det = a.shape[2:]
    for kind, (lo, hi) in BOUNDS.items():
        _assert_exact(
            out[kind].image, ref_virtual(a, ring(det, center, lo * radius, hi * radius)), np.uint64
        )
        np.testing.assert_array_equal(out[kind].image, getattr(detector, kind)(ds).image)
    _assert_exact(out["sum_dp"], ref_sum_dp(a), np.uint64)
    np.testing.assert_array_equal(out["mean_dp"], ref_mean_dp(a))
    _assert_exact(out["max_dp"], a.max(axis=(0, 1)), np.uint32)
    for k, v in ref_moments(a).items():
        _assert_exact(out["moments"][k], v, np.uint64)
    mr, mc, zeros = ref_com(a)
    assert isinstance(out["com"], dpc.CoM)
    np.testing.assert_allclose(out["com"].com_row, mr, atol=1e-9)
    np.testing.assert_allclose(out["com"].com_col, mc, atol=1e-9)
    assert out["com"].zero_frames == zeros
    assert out.disk is not None and out.disk.radius_px == pytest.approx(radius, abs=1e-9)
    assert isinstance(out.provenance, dict)
    # A comma-separated string works too, and parameters reach every detector.
    out2 = detector.products(ds, "bf,adf", center=(4.0, 4.0), radius=2.0)
    _assert_exact(out2["bf"].image, ref_virtual(a, ring(det, (4.0, 4.0), 0, 2.0)), np.uint64)
    _assert_exact(out2["adf"].image, ref_virtual(a, ring(det, (4.0, 4.0), 2.0, 4.0)), np.uint64)
    # Without a detector there is no disk.
    only = detector.products(ds, ["sum_dp"])
    assert list(only) == ["sum_dp"]


def test_provenance_names_operation_and_dataset(files):
    master, _ = files["u32"]
    with io.load(master, backend="cpu") as ds:
        res = detector.adf(ds)
        p = res.provenance
        assert p["backend"] == "cpu"
        assert p["representation"] == "dense"
        assert "adf" in p["operation"] or "detector" in p["operation"]
        assert p["dataset"]["backend"] == "cpu"
        assert isinstance(p["params"], dict)


# ----------------------------------------------------------------------------- errors


def test_errors(files):
    master, _ = files["u32"]
    ds = io.load(master, backend="cpu")
    with pytest.raises(ValueError) as e:
        detector.virtual_image(ds, np.ones((11, 12), bool))
    assert isinstance(e.value, qg.InvalidArgumentError)
    assert "11, 13" in str(e.value) and "11, 12" in str(e.value), str(e.value)
    with pytest.raises(qg.InvalidArgumentError):
        detector.virtual_image(ds, np.ones(DET[0] * DET[1], bool))  # flat, not (k_r, k_c)
    with pytest.raises(qg.InvalidArgumentError):
        detector.virtual_image(ds, -np.ones(DET, np.int64))
    with pytest.raises(qg.InvalidArgumentError):
        detector.virtual_image(ds, np.full(DET, 70000, np.uint32))
    bad = np.zeros(DET)
    bad[1, 1] = np.nan
    with pytest.raises(qg.InvalidArgumentError):
        detector.virtual_image(ds, bad)
    with pytest.raises(TypeError):
        detector.virtual_image(ds, np.zeros(DET, complex))
    with pytest.raises(qg.InvalidArgumentError):
        detector.frames(ds, [(SCAN[0], 0)])
    with pytest.raises(qg.InvalidArgumentError):
        detector.frames(ds, [(-1, 0)])
    with pytest.raises(qg.InvalidArgumentError):
        detector.roi_dp(ds)
    with pytest.raises(qg.InvalidArgumentError):
        detector.roi_dp(ds, rect=(0, 1, 0, 1), positions=[(0, 0)])
    with pytest.raises(qg.InvalidArgumentError):
        detector.roi_dp(ds, rect=(0, SCAN[0] + 1, 0, 1))
    with pytest.raises(qg.InvalidArgumentError):
        detector.roi_dp(ds, rect=(0, 1, 0, 1), reduce="median")
    with pytest.raises(qg.InvalidArgumentError):
        detector.roi_dp(ds, circle=(100.0, 100.0, 0.5))  # no position inside
    with pytest.raises(qg.InvalidArgumentError):
        detector.products(ds, ["bf", "ssb"])
    with pytest.raises(qg.InvalidArgumentError):
        detector.products(ds, [])
    # No angular calibration in these files: mrad without sampling or semi-angle is refused.
    with pytest.raises(qg.InvalidArgumentError, match="mrad"):
        detector.adf(ds, inner=5.0, outer=10.0, unit="mrad")
    with pytest.raises(qg.InvalidArgumentError):
        detector.adf(ds, unit="furlong")
    with pytest.raises(qg.InvalidArgumentError):
        detector.adf(ds, inner=3.0, outer=1.0)
    with pytest.raises(qg.InvalidArgumentError):
        detector.bf(ds, radius=-1.0)
    with pytest.raises(qg.InvalidArgumentError):
        detector.annular(ds)  # no default bounds
    with pytest.raises(qg.InvalidArgumentError):
        detector.products(ds, ["bf", "adf"], inner=1.0, outer=2.0)  # which detector?
    err = None
    try:
        detector.roi_dp(ds)
    except qg.InvalidArgumentError as ex:
        err = ex
    assert err is not None and err.op == "detector.roi_dp" and err.expected
    ds.close()
    with pytest.raises(qg.InvalidArgumentError):
        detector.sum_dp(ds)
    with pytest.raises(qg.InvalidArgumentError):
        detector.adf(ds)


def test_public_names():
    public = "sum_dp mean_dp max_dp frames roi_dp virtual_image fit_disk"
    detectors = "bf abf adf haadf df annular moments products"
    for name in (public + " " + detectors).split():
        assert callable(getattr(detector, name)), name
        assert getattr(detector, name).__doc__, name
    assert qg.detector is detector and qg.dpc is dpc


# ----------------------------------------------------------------------------- CUDA and others


@pytest.mark.skipif("cuda" not in device.available(), reason="no usable CUDA backend here")
@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_cuda_equals_the_numpy_reference(files, representation):
    master, a = files["u16"]
    with io.load(master, backend="cuda", representation=representation) as ds:
        out = detector.products(ds, ["bf", "adf", "df", "sum_dp", "max_dp", "moments", "com"])
        center, radius, _, _ = ref_fit_disk(a)
        for kind in ("bf", "adf", "df"):
            lo, hi = BOUNDS[kind]
            want = ref_virtual(a, ring(DET, center, lo * radius, hi * radius))
            _assert_exact(out[kind].image, want, np.uint64)
        _assert_exact(out["sum_dp"], ref_sum_dp(a), np.uint64)
        _assert_exact(out["max_dp"], a.max(axis=(0, 1)), np.uint32)
        for k, v in ref_moments(a).items():
            _assert_exact(out["moments"][k], v, np.uint64)
        m = np.random.default_rng(1).integers(0, 3, size=DET)
        _assert_exact(detector.virtual_image(ds, m), ref_virtual(a, m), np.uint64)
        assert out.provenance["backend"] == "cuda"


def test_against_libertem_ring_and_sum(files):
    """LiberTEM's ring analysis and sum (boundary radii avoided: LiberTEM includes it, as we do)."""
    api = pytest.importorskip("libertem.api", reason="LiberTEM is not installed here")
    master, a = files["u32"]
    ctx = api.Context.make_with("inline")
    lt_ds = ctx.load("memory", data=a.astype(np.float64), sig_dims=2)
    cy, cx, ri, ro = 5.3, 6.1, 1.37, 3.61
    res = ctx.run(ctx.create_ring_analysis(dataset=lt_ds, cx=cx, cy=cy, ri=ri, ro=ro))
    with io.load(master, backend="cpu") as ds:
        ours = detector.annular(ds, inner=ri, outer=ro, center=(cy, cx))
        np.testing.assert_allclose(
            ours.image.astype(np.float64), res.intensity.raw_data, rtol=1e-12
        )
        summed = ctx.run(ctx.create_sum_analysis(dataset=lt_ds))
        np.testing.assert_allclose(
            detector.sum_dp(ds).astype(np.float64), summed.intensity.raw_data
        )


def test_against_py4dstem_virtual_image(files):
    """py4DSTEM's annular virtual image (it excludes the outer boundary: radii avoid pixels)."""
    py4dstem = pytest.importorskip("py4DSTEM", reason="py4DSTEM is not installed (needs numpy < 2)")
    master, a = files["u32"]
    cube = py4dstem.DataCube(data=a.astype(np.float64))
    cy, cx, ri, ro = 5.3, 6.1, 1.37, 3.61
    vi = cube.get_virtual_image(mode="annulus", geometry=((cy, cx), (ri, ro)), name="ring")
    with io.load(master, backend="cpu") as ds:
        ours = detector.annular(ds, inner=ri, outer=ro, center=(cy, cx))
        np.testing.assert_allclose(ours.image.astype(np.float64), np.asarray(vi.data), rtol=1e-12)


def test_against_libertem_com(files):
    """LiberTEM's centre-of-mass analysis (whole detector): shifts from (cy, cx), y = rows."""
    api = pytest.importorskip("libertem.api", reason="LiberTEM is not installed here")
    master, a = files["u32"]
    ctx = api.Context.make_with("inline")
    lt_ds = ctx.load("memory", data=a.astype(np.float64), sig_dims=2)
    cy, cx = 5.0, 6.0
    res = ctx.run(ctx.create_com_analysis(dataset=lt_ds, cx=cx, cy=cy, mask_radius=None))
    with io.load(master, backend="cpu") as ds:
        com = dpc.center_of_mass(ds, centered=False)
    np.testing.assert_allclose(com.com_row - cy, res.y.raw_data, rtol=0, atol=1e-9)
    np.testing.assert_allclose(com.com_col - cx, res.x.raw_data, rtol=0, atol=1e-9)
