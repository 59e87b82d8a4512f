"""Single-sideband ptychography (``quantem.gpu.ssb``) against a NumPy float64 SSB written here.

The acquisition is simulated in this file (independent of the engine and of ``qem-sim``): a
weak-phase object ``t = exp(iσV)`` (Gaussian bumps on a periodic grid), an aberrated probe
``P(k) = A(k)·exp(−iχ(k))`` with the Krivanek ``χ`` (``χ ⊃ π C10 α²/λ``), frames
``|FFT(ψ·t_R)|²`` cropped to the detector, scaled to counts and rounded (no noise, so that the
reference and the engine see the same integers). The scan is rectangular and not a power of
two (17 × 22), the detector odd-free but not square-symmetric in use (rotation tested).

The reference SSB (:func:`ref_ssb`) follows docs/science.md §9 / anchor §8: BF pixels from the
float32 mean DP (``> mean + std``, unweighted centroid, equal-area radius, ``|k − c|² ≤ r²``),
``Δθ = α / r`` unless given, ``k_b = R(θ) k⁰_b``, the soft aperture of §8.3, ``G_b`` the
unnormalised scan FFT, ``Γ_b(ν) = P(k_b − ν)P*(k_b) − P(k_b)P*(k_b + ν)`` (derived from the
forward model below; the anchor's ``P(ν − k_b)`` differs for odd terms only), the phase-only
correction with ``C_b(0) = mean_b G_b(0)``, object = mean of the corrected per-pixel terms, and
the anchor's phase-variance loss. Metric: relative L2 of the complex object ≤ 1e-9 and the
loss to rel 1e-9 (the engine is float64 — see OBJECT_RTOL).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from numpy_reference import centred_probe, periodic_bumps, scanned_frames, wavelength_a

import quantem.gpu as qg
from quantem.gpu import io, ssb

VOLTAGE_KV = 300.0
SEMIANGLE_MRAD = 20.0
SCAN = (17, 22)  # rectangular, neither side a power of two
STEP_PX = 3  # scan step in simulation pixels
WINDOW = 48  # simulation window (pixels); the detector is its central DET
DET = (24, 24)
BF_RADIUS_PX = 6.0  # the aperture edge on the detector, pixels
TRUE = {"C10": 60.0, "C12": 15.0, "phi12": 0.4}

# The engine computes in float64 (rustfft f64); measured against this reference: rel L2 ≈ 4e-16
# and loss rel ≈ 1e-15. The bound leaves room for summation order yet fails on any convention
# difference (a sign of φ, P(ν − k) for odd terms, a half-pixel centre, a missing DC fix all
# give > 1e-3).
OBJECT_RTOL = 1e-9
LOSS_RTOL = 1e-9


LAM = wavelength_a(VOLTAGE_KV)
DTHETA_TRUE = SEMIANGLE_MRAD / BF_RADIUS_PX  # mrad per detector pixel
DK = DTHETA_TRUE * 1e-3 / LAM  # Å⁻¹ per pixel
DX = 1.0 / (WINDOW * DK)  # Å per simulation pixel
STEP_A = STEP_PX * DX


def chi(kr, kc, ab, lam=LAM):
    """Krivanek χ (rad) at spatial frequency (kr, kc) [Å⁻¹]; ab in Å / rad."""
    a = lam * np.hypot(kr, kc)
    phi = np.arctan2(kc, kr)
    g = ab.get
    return (2 * np.pi / lam) * (
        g("C10", 0.0) * a**2 / 2
        + g("C12", 0.0) * a**2 / 2 * np.cos(2 * (phi - g("phi12", 0.0)))
        + g("C21", 0.0) * a**3 / 3 * np.cos(phi - g("phi21", 0.0))
        + g("C23", 0.0) * a**3 / 3 * np.cos(3 * (phi - g("phi23", 0.0)))
        + g("C30", 0.0) * a**4 / 4
    )


# ----------------------------------------------------------------------------- simulation


def simulate(ab=TRUE, scale=4000.0):
    """uint32 counts ``(R_r, R_c, k_r, k_c)`` and the projected phase σV on the scan."""
    probe = centred_probe(WINDOW, DX, LAM, SEMIANGLE_MRAD, lambda kr, kc: chi(kr, kc, ab))
    bumps = (
        (10.0, 12.0, 2.0),
        (32.0, 40.0, 2.5),
        (40.0, 14.0, 1.8),
        (14.0, 52.0, 2.2),
        (25.0, 25.0, 2.0),
    )
    phase = 0.3 * periodic_bumps((SCAN[0] * STEP_PX, SCAN[1] * STEP_PX), bumps)
    out = scanned_frames(probe, np.exp(1j * phase), SCAN, STEP_PX, DET)
    counts = np.rint(out / out.max() * scale).astype(np.uint32)
    truth = phase[::STEP_PX, ::STEP_PX][: SCAN[0], : SCAN[1]]
    return counts, truth


@pytest.fixture(scope="module")
def data():
    counts, truth = simulate()
    return {"counts": counts, "truth": truth}


#: The optics of the simulation, as every SSB here is built with unless a test says otherwise.
# The detector sampling is given (the simulation's), so the reconstruction tests compare the
# engines with the reference at one calibration; test_default_sampling_* checks the default rule.
OPTICS = dict(
    voltage_kv=VOLTAGE_KV,
    semiangle_mrad=SEMIANGLE_MRAD,
    scan_step_a=STEP_A,
    det_sampling_mrad=DTHETA_TRUE,
)


def make_ssb(ds, **kw):
    """ssb.SSB on ``ds`` with OPTICS, overridden or extended by ``kw``."""
    return ssb.SSB(ds, **{**OPTICS, **kw})


@pytest.fixture(scope="module")
def prepared(data):
    ds = io.load(data["counts"], backend="cpu")
    return make_ssb(ds)


# ----------------------------------------------------------------------------- reference


def ref_disk(a):
    """(center, radius) from the float32 mean DP, in float64 (docs/science.md §3 disk fit)."""
    n = a.shape[0] * a.shape[1]
    s = a.astype(np.uint64).sum(axis=(0, 1), dtype=np.uint64)
    mean = (s.astype(np.float64) / n).astype(np.float32).astype(np.float64)
    sel = mean > mean.mean() + mean.std()
    i, j = np.nonzero(sel)
    return (float(i.mean()), float(j.mean())), math.sqrt(sel.sum() / math.pi), mean


def ref_prepare(a, *, det_sampling_mrad=None, rotation_deg=0.0, bf_threshold=0.0):
    (cr, cc), radius, mean = ref_disk(a)
    kr_n, kc_n = a.shape[-2:]
    i, j = np.mgrid[:kr_n, :kc_n]
    cand = mean > bf_threshold * mean.max()
    # float32 membership test, as the anchor's BrightfieldDisk.
    d2 = (i.astype(np.float32) - np.float32(cr)) ** 2 + (j.astype(np.float32) - np.float32(cc)) ** 2
    inside = cand & (d2 <= np.float32(radius) ** 2)
    bi, bj = np.nonzero(inside)  # row-major order
    dtheta = DTHETA_TRUE if det_sampling_mrad is None else det_sampling_mrad
    dk = dtheta * 1e-3 / LAM
    k0r, k0c = (bi - cr) * dk, (bj - cc) * dk
    th = math.radians(rotation_deg)
    kbr = math.cos(th) * k0r - math.sin(th) * k0c
    kbc = math.sin(th) * k0r + math.cos(th) * k0c
    g = np.fft.fft2(a[:, :, bi, bj].astype(np.float64), axes=(0, 1))  # (R_r, R_c, B)
    vr = np.fft.fftfreq(a.shape[0], d=STEP_A)[:, None]
    vc = np.fft.fftfreq(a.shape[1], d=STEP_A)[None, :]
    return {"g": g, "kbr": kbr, "kbc": kbc, "vr": vr, "vc": vc, "dtheta": dtheta, "n_bf": bi.size}


def ref_probe(vr, vc, ab, dtheta):
    """P(v) = A(v)·exp(−iχ(v)) with the soft (one-pixel) aperture edge of anchor §8.3."""
    a = LAM * np.hypot(vr, vc)
    delta = dtheta * 1e-3  # isotropic sampling: δ(v) = Δθ
    aperture = np.clip((SEMIANGLE_MRAD * 1e-3 - a) / delta + 0.5, 0.0, 1.0)
    return aperture * np.exp(-1j * chi(vr, vc, ab))


def ref_ssb(p, ab):
    """(object, per-pixel objects O_b) — float64, every BF pixel, full spectra."""
    g = p["g"]
    vr, vc = p["vr"][..., None], p["vc"][..., None]
    kr, kc = p["kbr"][None, None, :], p["kbc"][None, None, :]
    pk = ref_probe(kr, kc, ab, p["dtheta"])
    # The forward model of simulate() gives, at first order in the phase,
    # G_b(ν) = iΦ(ν)·[P(k_b − ν)P*(k_b) − P(k_b)P*(k_b + ν)]; the anchor's P(ν − k_b) is the
    # same for C10, C12, C30 only (the odd-terms case tells them apart).
    gamma = (
        ref_probe(kr - vr, kc - vc, ab, p["dtheta"]) * np.conj(pk)
        - np.conj(ref_probe(kr + vr, kc + vc, ab, p["dtheta"])) * pk
    )
    mag2 = np.abs(gamma) ** 2
    safe = np.where(mag2 > 1e-16, np.abs(gamma), 1.0)
    corr = np.where(mag2 > 1e-16, g * np.conj(gamma) / safe, g * np.conj(gamma) * 1e8)
    corr[0, 0, :] = g[0, 0, :].mean()
    per_pixel = np.fft.ifft2(corr, axes=(0, 1))
    return per_pixel.mean(axis=2), per_pixel


def ref_phase_variance(per_pixel):
    ph = np.angle(per_pixel)
    v = (ph**2).mean(axis=2) - ph.mean(axis=2) ** 2
    return float(v.mean())


def rel_l2(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def corr(a, b):
    a = a - a.mean()
    b = b - b.mean()
    return float((a * b).sum() / math.sqrt((a * a).sum() * (b * b).sum()))


# ----------------------------------------------------------------------------- tests


def test_reference_is_physical(data):
    """The test's own SSB recovers the object at the true aberrations (sanity of the test)."""
    p = ref_prepare(data["counts"])
    obj_true, pp_true = ref_ssb(p, TRUE)
    obj_zero, _ = ref_ssb(p, {})
    c_true = corr(np.angle(obj_true), data["truth"])
    c_zero = corr(np.angle(obj_zero), data["truth"])
    assert c_true > 0.9, c_true
    assert c_true > c_zero + 0.05, (c_true, c_zero)
    # The anchor's loss is lowest at the true defocus (and its sign matters).
    loss_true = ref_phase_variance(pp_true)
    for c10 in (-60.0, 0.0, 30.0, 90.0):
        _, pp = ref_ssb(p, {**TRUE, "C10": c10})
        assert loss_true < ref_phase_variance(pp), c10


@pytest.mark.parametrize(
    "ab",
    [
        {},
        TRUE,
        {"C10": -35.0, "C12": 8.0, "phi12": -1.1, "C30": 2.0e4},
        {"C10": 20.0, "C21": 300.0, "phi21": 0.7, "C23": 150.0, "phi23": -0.3},
    ],
    ids=["zero", "true", "negative-defocus-cs", "odd-terms"],
)
def test_reconstruct_matches_numpy(data, prepared, ab):
    p = ref_prepare(data["counts"])
    assert prepared.info["n_bf"] == p["n_bf"]
    want, per_pixel = ref_ssb(p, ab)
    r = prepared.reconstruct(ab)
    assert r.object.dtype == np.complex128 and r.object.shape == SCAN
    err = rel_l2(r.object, want)
    assert err <= OBJECT_RTOL, err
    np.testing.assert_allclose(r.amplitude, np.abs(r.object), rtol=1e-12)
    np.testing.assert_allclose(r.phase, np.angle(r.object), atol=1e-12)
    # Re(object) is the DC but for the Nyquist column of this even scan side (its mirror is not
    # −ν, and Nyquist lies inside 2α here): constant to ~5e-4. The weak phase is Im over its mean.
    d = want.real.mean()
    np.testing.assert_allclose(want.real, d, rtol=2e-3)
    np.testing.assert_allclose(r.weak_phase, want.imag / d, rtol=1e-9, atol=1e-12)
    assert np.asarray(r).shape == SCAN
    for k in ssb.ABERRATIONS:
        assert r.aberrations[k] == pytest.approx(ab.get(k, 0.0))
    loss = prepared.objective(ab, "phase_variance")
    assert loss == pytest.approx(ref_phase_variance(per_pixel), rel=LOSS_RTOL)


def test_rotation_and_explicit_sampling(data):
    ds = io.load(data["counts"], backend="cpu")
    s = make_ssb(ds, scan_step_a=(STEP_A, STEP_A), det_sampling_mrad=DTHETA_TRUE, rotation_deg=17.0)
    assert s.info["det_sampling_mrad"] == pytest.approx(DTHETA_TRUE)
    p = ref_prepare(data["counts"], det_sampling_mrad=DTHETA_TRUE, rotation_deg=17.0)
    want, _ = ref_ssb(p, TRUE)
    err = rel_l2(s.reconstruct(TRUE).object, want)
    assert err <= OBJECT_RTOL, err


def test_encoded_equals_dense(data, prepared):
    ds = io.load(data["counts"], backend="cpu", representation="encoded", dtype="u16")
    s = make_ssb(ds)
    a = s.reconstruct(TRUE).object
    b = prepared.reconstruct(TRUE).object
    assert rel_l2(a, b) <= 1e-12
    assert s.reconstruct(TRUE).provenance["representation"] == "encoded"


def test_default_sampling_is_alpha_over_the_disk_edge(data):
    """Without det_sampling_mrad: α / r_edge (sub-pixel disk edge), near the simulation's true
    sampling; compat_2alpha keeps the anchor's 2α / r_BF with the threshold radius."""
    _, radius, _ = ref_disk(data["counts"])
    ds = io.load(data["counts"], backend="cpu")
    default = make_ssb(ds, det_sampling_mrad=None)
    assert default.info["det_sampling_mrad"] == pytest.approx(DTHETA_TRUE, rel=0.02)
    compat = make_ssb(ds, det_sampling_mrad=None, compat_2alpha=True)
    assert compat.info["det_sampling_mrad"] == pytest.approx(2 * SEMIANGLE_MRAD / radius, rel=1e-9)


def test_fit_is_deterministic_and_improves(prepared):
    kw = dict(seed=3, global_evals=24, local_max_iter=30)
    a = prepared.fit(**kw)
    b = prepared.fit(**kw)
    assert a.aberrations == b.aberrations
    assert a.loss == b.loss and a.evaluations == b.evaluations
    np.testing.assert_array_equal(a.loss_curve, b.loss_curve)
    assert a.fitted == ssb.DEFAULT_FIT
    assert a.objective == "coherence"
    assert set(a.aberrations) == set(ssb.ABERRATIONS)
    assert a.units["C10"] == "Å" and a.units["phi12"] == "rad"
    assert a.evaluations > 24 and a.loss_curve.size == a.evaluations  # start + 24 + NM
    assert a.loss == pytest.approx(a.loss_curve.min())
    assert a.loss == pytest.approx(prepared.objective(a.aberrations), rel=1e-9)
    assert a.loss <= prepared.objective({})
    np.testing.assert_allclose(a.result.object, prepared.reconstruct(a.aberrations).object)
    # Only the named coefficients move; the others keep their start value.
    c = prepared.fit(seed=3, fit=("C10",), global_evals=8, local_max_iter=10, start={"C12": 5.0})
    assert c.fitted == ("C10",)
    assert c.aberrations["C12"] == 5.0 and c.aberrations["phi12"] == 0.0
    assert "C10" in repr(c)


def test_fit_coarse_option(prepared):
    """``coarse=`` reaches the engine: recorded in the provenance, strictly a bool. This disk is
    too small for a coarse sample (< 256 pixels), so both fits are the all-pixel fit, equal."""
    kw = dict(seed=3, global_evals=16, local_max_iter=20)
    a = prepared.fit(**kw)
    b = prepared.fit(coarse=False, **kw)
    fa, fb = a.provenance["params"]["fit"], b.provenance["params"]["fit"]
    assert fa["coarse"] is False and fa["coarse_pixels"] == 0 and fa["coarse_evaluations"] == 0
    assert fb["coarse"] is False
    assert a.aberrations == b.aberrations
    np.testing.assert_array_equal(a.loss_curve, b.loss_curve)
    with pytest.raises(TypeError, match="coarse"):
        prepared.fit(coarse="yes", **kw)


def test_fit_recovers_the_probe(data):
    """Noise-free data, true detector sampling: the default 3-parameter fit finds TRUE."""
    ds = io.load(data["counts"], backend="cpu")
    s = make_ssb(ds, det_sampling_mrad=DTHETA_TRUE)
    for objective in s.objectives:
        f = s.fit(seed=0, objective=objective, global_evals=80, local_max_iter=120)
        assert f.aberrations["C10"] == pytest.approx(TRUE["C10"], abs=3.0), (objective, f)
        assert f.aberrations["C12"] == pytest.approx(TRUE["C12"], abs=2.0), (objective, f)
        assert f.aberrations["phi12"] == pytest.approx(TRUE["phi12"], abs=0.1), (objective, f)


def test_fit_respects_ranges(prepared):
    f = prepared.fit(
        seed=1, fit=("C10",), ranges={"C10": (10.0, 30.0)}, global_evals=10, local_max_iter=0
    )
    assert 10.0 <= f.aberrations["C10"] <= 30.0


def test_errors(data, prepared):
    ds = io.load(data["counts"], backend="cpu")
    with pytest.raises(ValueError, match="voltage_kv"):
        ssb.SSB(ds, semiangle_mrad=20.0, scan_step_a=0.4)
    with pytest.raises(qg.InvalidArgumentError, match="semiangle_mrad"):
        ssb.SSB(ds, voltage_kv=300.0, scan_step_a=0.4)
    with pytest.raises(ValueError, match="scan_step_a"):
        ssb.SSB(ds, voltage_kv=300.0, semiangle_mrad=20.0)
    with pytest.raises(ValueError, match="scan_step_a"):
        ssb.SSB(ds, voltage_kv=300.0, semiangle_mrad=20.0, scan_step_a=(0.4, 0.4, 0.4))
    with pytest.raises(ValueError, match="voltage_kv"):
        ssb.SSB(ds, voltage_kv=-1.0, semiangle_mrad=20.0, scan_step_a=0.4)
    with pytest.raises(ValueError, match="C99"):
        prepared.reconstruct({"C99": 1.0})
    with pytest.raises(ValueError, match="objective"):
        prepared.fit(objective="nope")
    with pytest.raises(ValueError, match="C77"):
        prepared.fit(fit=("C77",))
    with pytest.raises(ValueError, match="low < high"):
        prepared.fit(ranges={"C10": (5.0, -5.0)})
    with pytest.raises(qg.MemoryBudgetError):
        ssb.SSB(ds, voltage_kv=300.0, semiangle_mrad=20.0, scan_step_a=0.4, memory_budget=1024)


def test_surface(prepared):
    assert "phase_variance" in prepared.objectives
    # The robust loss is the default (it alone passes the realistic-dose abTEM validation).
    assert prepared.objectives[0] == ssb.OBJECTIVES[0] == "coherence"
    assert len(prepared.objectives) >= 2  # the anchor's objective and a robust one
    for name in prepared.objectives:
        assert math.isfinite(prepared.objective(TRUE, name))
    r = prepared.reconstruct(TRUE)
    assert r.provenance["operation"].startswith("ssb")
    assert r.provenance["backend"] == "cpu"
    assert "SSBResult" in repr(r) and "SSB(" in repr(prepared)


# ----------------------------------------------------------------------------- CUDA


CUDA_AVAILABLE = "cuda" in qg.device.available()


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="CUDA backend unavailable")
@pytest.mark.parametrize("representation", ["dense", "encoded"])
@pytest.mark.parametrize("g_storage,tol", [("f32", 1e-5), ("f16", 5e-4), ("f12", 5e-3)])
@pytest.mark.parametrize(
    "ab",
    [TRUE, {"C10": 20.0, "C21": 300.0, "phi21": 0.7, "C23": 150.0, "phi23": -0.3, "C30": 2e4}],
    ids=["true", "odd-terms-cs"],
)
def test_cuda_matches_numpy_reference(data, ab, representation, g_storage, tol):
    """The CUDA engine (G on the card, losses on the GPU) against the NumPy float64 reference."""
    ds = io.load(data["counts"], backend="cuda", representation=representation, dtype="u16")
    s = make_ssb(ds, g_storage=g_storage)
    assert s.info["engine"] == "cuda"
    assert s.info["cuda"]["g_storage"].startswith("half spectrum, complex " + g_storage)
    p = ref_prepare(data["counts"])
    assert s.info["n_bf"] == p["n_bf"]
    want, per_pixel = ref_ssb(p, ab)
    err = rel_l2(s.reconstruct(ab).object, want)
    assert err <= tol, err
    loss = s.objective(ab, "phase_variance")
    assert loss == pytest.approx(ref_phase_variance(per_pixel), rel=max(tol, LOSS_RTOL))


@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_engine_cuda_on_host_data(data, representation):
    """engine="cuda" on a dataset held by the CPU engine: SSB on the card (the NumPy reference
    bounds it), or a typed refusal where there is no GPU — never a silent CPU run."""
    ds = io.load(data["counts"], backend="cpu", representation=representation, dtype="u16")
    if not CUDA_AVAILABLE:
        with pytest.raises(qg.BackendUnavailableError, match="cuda"):
            make_ssb(ds, engine="cuda")
        return
    s = make_ssb(ds, engine="cuda")
    assert s.info["engine"] == "cuda"
    want, _ = ref_ssb(ref_prepare(data["counts"]), TRUE)
    err = rel_l2(s.reconstruct(TRUE).object, want)
    assert err <= 1e-5, err


def test_engine_names(data):
    ds = io.load(data["counts"], backend="cpu")
    with pytest.raises(ValueError, match="engine"):
        make_ssb(ds, engine="gpu2")
    assert make_ssb(ds, engine="cpu").info["engine"] == "cpu"
    if CUDA_AVAILABLE:
        on_card = io.load(data["counts"], backend="cuda")
        with pytest.raises(qg.InvalidArgumentError, match="host"):
            make_ssb(on_card, engine="cpu")
