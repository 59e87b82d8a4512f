"""Centre of mass, DPC and iDPC (``quantem.gpu.dpc``) against NumPy float64 implementations.

The synthetic acquisition has a known answer: a positive "projected potential" φ on the scan
(Gaussian bumps), and per scan position a frame whose centre of mass is the gradient ∇φ rotated
by −23° into the detector frame (optionally with the two components exchanged, a transposed
detector): a bright Gaussian spot shifted by that amount, plus a ring in the dark field whose
intensity follows φ (more scattering on the bumps, so the ADF image correlates with φ, which is
what the engine's 180° criterion uses). The ring is symmetric about the detector centre, so it
does not move the centre of mass; the spot's shift is scaled to make up for the ring's weight.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from numpy_reference import idpc

import quantem.gpu as qg
from quantem.gpu import detector, device, dpc, io

ROTATION_DEG = 23.0
SCAN = (23, 27)  # odd and rectangular
DET = (31, 33)
C0 = (15.0, 16.0)  # detector centre: the ring is symmetric about it
SIGMA = 1.5
SPOT = 20000.0
RING = (4.2, 5.8, 400.0)  # inner, outer radius (px) and peak intensity of the dark-field ring


def ref_com(a, centered=True):
    a64 = a.astype(np.float64)
    kr, kc = a.shape[-2:]
    s = a64.sum(axis=(2, 3))
    mr = (a64 * np.arange(kr)[:, None]).sum(axis=(2, 3))
    mc = (a64 * np.arange(kc)[None, :]).sum(axis=(2, 3))
    safe = np.where(s > 0, s, 1.0)
    mr = np.where(s > 0, mr / safe, 0.0)
    mc = np.where(s > 0, mc / safe, 0.0)
    if centered:
        mr, mc = mr - mr.mean(), mc - mc.mean()
    return mr, mc


def rotate(a, b, theta):
    """g = R(theta) (a, b): g_r = cos a - sin b, g_c = sin a + cos b."""
    c, s = math.cos(theta), math.sin(theta)
    return c * a - s * b, s * a + c * b


def potential(scan):
    """Positive bumps on a lattice, and their central-difference gradient per scan step.

    The gradient is ``(φ(r+1) − φ(r−1)) / 2`` of the analytic φ (evaluated past the edges too),
    so the central-difference curl the rotation search minimises is exactly zero at the true
    angle; only the rounding of the counts perturbs it.
    """

    def phi_at(r, c):
        out = np.zeros(np.broadcast(r, c).shape)
        w = 2.2
        for r0 in (4.0, 11.5, 18.5):
            for c0 in (4.5, 13.0, 21.5):
                out += np.exp(-((r - r0) ** 2 + (c - c0) ** 2) / (2 * w * w))
        return out

    r, c = np.mgrid[: scan[0], : scan[1]].astype(np.float64)
    gr = (phi_at(r + 1, c) - phi_at(r - 1, c)) / 2
    gc = (phi_at(r, c + 1) - phi_at(r, c - 1)) / 2
    return phi_at(r, c), gr, gc


def synthetic(transpose: bool, theta_deg: float = ROTATION_DEG, scale: float = 4.0):
    """Integer frames (uint32) whose CoM is R(-theta) grad(phi) (exchanged if transpose)."""
    phi, gr, gc = potential(SCAN)
    gr, gc = scale * gr, scale * gc
    # The engine applies g = R(theta) (a, b) with (a, b) = (mu_r, mu_c), or (mu_c, mu_r) when
    # transposed; so the detector sees (a, b) = R(-theta) g.
    a, b = rotate(gr, gc, -math.radians(theta_deg))
    mu_r, mu_c = (b, a) if transpose else (a, b)
    i, j = np.mgrid[: DET[0], : DET[1]].astype(np.float64)
    d2 = (i - C0[0]) ** 2 + (j - C0[1]) ** 2
    ring = ((d2 >= RING[0] ** 2) & (d2 <= RING[1] ** 2)).astype(np.float64)
    pn = phi / phi.max()
    frames = np.zeros(SCAN + DET)
    for r in range(SCAN[0]):
        for c in range(SCAN[1]):
            ring_f = RING[2] * pn[r, c] * ring
            spot = np.exp(-((i - C0[0]) ** 2 + (j - C0[1]) ** 2) / (2 * SIGMA**2))
            s_spot = SPOT * spot.sum()
            k = (s_spot + ring_f.sum()) / s_spot  # the ring dilutes the spot's shift
            dr, dc = k * mu_r[r, c], k * mu_c[r, c]
            spot = np.exp(-((i - C0[0] - dr) ** 2 + (j - C0[1] - dc) ** 2) / (2 * SIGMA**2))
            frames[r, c] = SPOT * spot + ring_f
    counts = np.rint(frames).astype(np.uint32)
    return counts, phi, (mu_r, mu_c)


@pytest.fixture(scope="module", params=[False, True], ids=["normal", "transposed"])
def rotated(request):
    counts, phi, mu = synthetic(request.param)
    # The integer frames really have the intended centre of mass (to rounding).
    mr, mc = ref_com(counts, centered=False)
    np.testing.assert_allclose(mr - C0[0], mu[0], atol=5e-3)
    np.testing.assert_allclose(mc - C0[1], mu[1], atol=5e-3)
    return {"counts": counts, "phi": phi, "transpose": request.param}


def _corr(a, b):
    a = a - a.mean()
    b = b - b.mean()
    return float((a * b).sum() / math.sqrt((a * a).sum() * (b * b).sum()))


def _ang_diff(a, b):
    """Smallest |a − b| in degrees modulo 360."""
    d = (a - b) % 360.0
    return min(d, 360.0 - d)


CUDA = pytest.mark.skipif("cuda" not in device.available(), reason="no usable CUDA backend here")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_rotation_transpose_sign_and_phase_are_recovered(rotated, representation, backend):
    counts = rotated["counts"]
    if representation == "encoded":
        assert counts.max() < 65536
        counts = counts.astype(np.uint16)
    with io.load(counts, backend=backend, representation=representation) as ds:
        assert ds.backend == backend
        res = dpc.run(ds)
    assert res.transpose is rotated["transpose"]
    assert _ang_diff(res.rotation_deg, ROTATION_DEG) < 0.1, res.rotation_deg
    assert res.sign_criterion == "adf_correlation", res.sign_criterion
    assert res.confident and res.sign_confidence > 0.5
    assert res.curl_score < 1e-3
    # The phase is the potential (positive bumps, positive phase), up to scale and offset.
    assert _corr(res.phase, rotated["phi"]) > 0.99
    # Every array against numpy: CoM, the aligned field at the returned angle, the phase.
    mr, mc = ref_com(counts)
    np.testing.assert_allclose(res.com_row, mr, atol=1e-9)
    np.testing.assert_allclose(res.com_col, mc, atol=1e-9)
    a, b = (mc, mr) if res.transpose else (mr, mc)
    gr, gc = rotate(a, b, math.radians(res.rotation_deg))
    np.testing.assert_allclose(res.dpc_row, gr, atol=1e-9)
    np.testing.assert_allclose(res.dpc_col, gc, atol=1e-9)
    want = idpc(gr, gc)
    np.testing.assert_allclose(res.phase, want - want.mean(), atol=1e-9 * np.abs(want).max())
    for arr in (res.com_row, res.dpc_col, res.phase):
        assert arr.shape == SCAN and arr.dtype == np.float64
    assert isinstance(res.provenance, dict) and res.provenance["operation"] == "dpc.run"
    assert "DPCResult" in repr(res)


@CUDA
@pytest.mark.parametrize("representation", ["dense", "encoded"])
def test_cuda_stages_equal_the_cpu_engine(rotated, representation):
    """On a CUDA dataset every stage after the reduction runs on the card: the same rotation,
    transpose and sign as the CPU engine, the CoM and aligned field bit for bit, the phase to
    rounding (cuFFT against rustfft), with either edge mode and an explicit angle."""
    counts = rotated["counts"].astype(np.uint16)
    flipped = not rotated["transpose"]
    with (
        io.load(counts, backend="cpu") as cpu_ds,
        io.load(counts, backend="cuda", representation=representation) as ds,
    ):
        for kw in ({}, {"edge": "mirror"}, {"rotation_deg": 200.0, "transpose": flipped}):
            want, got = dpc.run(cpu_ds, **kw), dpc.run(ds, **kw)
            assert got.provenance["params"]["stages_on"] == "cuda", kw
            assert (got.rotation_deg, got.transpose) == (want.rotation_deg, want.transpose), kw
            assert (got.sign_criterion, got.confident) == (want.sign_criterion, want.confident)
            assert abs(got.sign_confidence - want.sign_confidence) < 1e-9, kw
            for name in ("com_row", "com_col", "dpc_row", "dpc_col"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
            scale = np.abs(want.phase).max()
            np.testing.assert_allclose(got.phase, want.phase, rtol=0, atol=1e-12 * scale)


def test_explicit_rotation_is_used_as_given(rotated):
    counts = rotated["counts"]
    with io.load(counts, backend="cpu") as ds:
        res = dpc.run(ds, rotation_deg=ROTATION_DEG, transpose=rotated["transpose"], edge="mirror")
        wrong = dpc.run(ds, rotation_deg=ROTATION_DEG + 180.0, transpose=rotated["transpose"])
    assert res.rotation_deg == ROTATION_DEG and res.transpose is rotated["transpose"]
    assert res.sign_criterion == "explicit_rotation"
    mr, mc = ref_com(counts)
    a, b = (mc, mr) if rotated["transpose"] else (mr, mc)
    gr, gc = rotate(a, b, math.radians(ROTATION_DEG))
    np.testing.assert_allclose(res.dpc_row, gr, atol=1e-9)
    np.testing.assert_allclose(res.dpc_col, gc, atol=1e-9)
    assert _corr(res.phase, rotated["phi"]) > 0.98
    # The opposite orientation inverts the contrast, and the criterion says it disagrees.
    assert _corr(wrong.phase, rotated["phi"]) < -0.98
    assert not wrong.confident


def test_center_of_mass_against_numpy(rotated):
    counts = rotated["counts"].copy()
    counts[0, :4] = 0  # all-zero frames: CoM 0, counted
    with io.load(counts, backend="cpu") as ds:
        for centered in (True, False):
            com = dpc.center_of_mass(ds, centered=centered)
            mr, mc = ref_com(counts, centered)
            np.testing.assert_allclose(com.com_row, mr, atol=1e-9)
            np.testing.assert_allclose(com.com_col, mc, atol=1e-9)
            assert com.zero_frames == 4 and com.centered is centered and com.unit == "px"
    if not centered:
        assert np.all(com.com_row[0, :4] == 0)


def test_integrate_recovers_an_analytic_periodic_phase():
    for nr, nc in [(32, 48), (25, 19)]:
        r, c = np.mgrid[:nr, :nc].astype(np.float64)
        a, b = 2 * np.pi * 2 / nr, 2 * np.pi * 3 / nc
        e = 2 * np.pi / nr
        phi = np.sin(a * r) * np.cos(b * c) + 0.5 * np.cos(e * r)
        g_row = a * np.cos(a * r) * np.cos(b * c) - 0.5 * e * np.sin(e * r)
        g_col = -b * np.sin(a * r) * np.sin(b * c)
        got = dpc.integrate(g_row, g_col)
        assert got.shape == (nr, nc) and got.dtype == np.float64
        np.testing.assert_allclose(got, phi - phi.mean(), atol=1e-10)
        # Lists and float32 arrays are accepted.
        np.testing.assert_allclose(
            dpc.integrate(g_row.astype(np.float32), g_col.tolist()), phi - phi.mean(), atol=1e-5
        )


def test_integrate_mirror_edges_handle_a_non_periodic_phase():
    nr, nc = 40, 52
    r, c = np.mgrid[:nr, :nc].astype(np.float64)
    phi = 0.02 * r * c + 0.5 * np.sin(0.23 * r) + 0.01 * c**2
    g_row = 0.02 * c + 0.5 * 0.23 * np.cos(0.23 * r)
    g_col = 0.02 * r + 0.02 * c
    t = phi - phi.mean()

    def rel(x):
        return np.linalg.norm(x - x.mean() - t) / np.linalg.norm(t)

    assert rel(dpc.integrate(g_row, g_col, edge="mirror")) < 0.01
    assert rel(dpc.integrate(g_row, g_col, edge="periodic")) > 0.3


def test_small_scans_and_errors():
    # A 2-row scan: the rotation cannot be determined, and the result says so.
    counts, _, _ = synthetic(False)
    with io.load(np.ascontiguousarray(counts[:2]), backend="cpu") as ds:
        res = dpc.run(ds)
        assert not res.confident and res.sign_criterion == "none"
        with pytest.raises(qg.InvalidArgumentError):
            dpc.run(ds, edge="wrap")
        with pytest.raises(qg.InvalidArgumentError):
            dpc.run(ds, rotation_deg=float("nan"))
    with pytest.raises(qg.InvalidArgumentError):
        dpc.integrate(np.zeros((4, 5)), np.zeros((5, 4)))
    with pytest.raises(qg.InvalidArgumentError):
        dpc.integrate(np.zeros(20), np.zeros(20))
    with pytest.raises(qg.InvalidArgumentError):
        dpc.integrate(np.zeros((0, 3)), np.zeros((0, 3)))
    ds = io.load(counts, backend="cpu")
    ds.close()
    with pytest.raises(qg.InvalidArgumentError):
        dpc.center_of_mass(ds)


def test_products_com_equals_center_of_mass(rotated):
    with io.load(rotated["counts"], backend="cpu") as ds:
        out = detector.products(ds, ["com", "adf"])
        com = dpc.center_of_mass(ds)
    np.testing.assert_array_equal(out["com"].com_row, com.com_row)
    np.testing.assert_array_equal(out["com"].com_col, com.com_col)
    # The ADF image follows the potential (the ring), which the sign criterion relies on.
    assert _corr(out["adf"].image.astype(np.float64), rotated["phi"]) > 0.5
