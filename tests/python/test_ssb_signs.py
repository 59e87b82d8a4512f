"""Signs and units of the SSB aberration fit against a simulation written here (issue 20 item 3).

The acquisition is simulated in this file with NumPy (independent of the engine and of
``qem-sim``): a weak-phase object ``t = exp(iσV)`` (Gaussian bumps on a periodic grid), the
probe ``P(k) = A(k)·exp(−iχ(k))`` with the Krivanek ``χ`` of docs/science.md
(``χ ⊃ π C10 α²/λ``, ``C10 > 0`` = overfocus, ``φ`` measured from the scan row axis toward the
column axis), frames ``|FFT(ψ·t_R)|²`` with detector row ∥ scan row, then optionally rotated or
transposed on the detector. Expected values are the simulation's inputs (C12 direction
modulo π); the fit is the engine's, with the true detector sampling.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from numpy_reference import centred_probe, periodic_bumps, scanned_frames, wavelength_a

from quantem.gpu import dpc, io, ssb

VOLTAGE_KV = 200.0
SEMIANGLE_MRAD = 25.0
STEP_PX = 3  # scan step in simulation pixels
WINDOW = 40  # simulation window (pixels); the detector is its central DET
DET = 24
BF_RADIUS_PX = 7.0  # the aperture edge on the detector, pixels


LAM = wavelength_a(VOLTAGE_KV)
DTHETA = SEMIANGLE_MRAD / BF_RADIUS_PX  # mrad per detector pixel
DX = LAM / (WINDOW * DTHETA * 1e-3)  # Å per simulation pixel
STEP_A = STEP_PX * DX


def _chi(kr, kc, ab):
    """χ (rad) at spatial frequency (kr, kc) [Å⁻¹]; C10, C12 in Å, phi12 in rad."""
    a = LAM * np.hypot(kr, kc)
    phi = np.arctan2(kc, kr)
    c10, c12, p12 = ab.get("C10", 0.0), ab.get("C12", 0.0), ab.get("phi12", 0.0)
    return (2 * np.pi / LAM) * (a**2 / 2) * (c10 + c12 * np.cos(2 * (phi - p12)))


def simulate(ab: dict, scan: tuple[int, int] = (16, 20), detector: str = "identity"):
    """uint32 counts ``(R_r, R_c, DET, DET)``; ``detector`` is ``"identity"``, ``"rot90"``
    (``np.rot90`` of every frame) or ``"transpose"`` (frame axes exchanged)."""
    probe = centred_probe(WINDOW, DX, LAM, SEMIANGLE_MRAD, lambda kr, kc: _chi(kr, kc, ab))
    gr, gc = scan[0] * STEP_PX, scan[1] * STEP_PX
    rng = np.random.default_rng(7)
    bumps = zip(rng.uniform(0, gr, 9), rng.uniform(0, gc, 9), rng.uniform(1.5, 2.5, 9))
    t = np.exp(1j * 0.3 * periodic_bumps((gr, gc), bumps))
    out = scanned_frames(probe, t, scan, STEP_PX, (DET, DET))
    if detector == "rot90":
        out = np.rot90(out, k=1, axes=(2, 3))
    elif detector == "transpose":
        out = np.swapaxes(out, 2, 3)
    return np.ascontiguousarray(np.rint(out / out.max() * 4000.0).astype(np.uint32))


def _fit(counts, rotation_deg: float = 0.0, fit=("C10", "C12", "phi12"), transpose=False) -> dict:
    ds = io.load(counts, backend="cpu")
    s = ssb.SSB(
        ds,
        voltage_kv=VOLTAGE_KV,
        semiangle_mrad=SEMIANGLE_MRAD,
        scan_step_a=STEP_A,
        det_sampling_mrad=DTHETA,
        rotation_deg=rotation_deg,
        transpose=transpose,
    )
    return s.fit(seed=0, fit=fit, global_evals=40, local_max_iter=80).aberrations


def _angle_mod_pi(a: float, b: float) -> float:
    """|a − b| modulo π, in [0, π/2]."""
    d = (a - b) % math.pi
    return min(d, math.pi - d)


@pytest.mark.parametrize("c10", [-80.0, 80.0], ids=["underfocus", "overfocus"])
def test_defocus_sign(c10):
    """C10 < 0 is underfocus (abTEM defocus > 0), C10 > 0 overfocus; the fit keeps the sign
    and the value in Å."""
    got = _fit(simulate({"C10": c10}), fit=("C10",))
    assert got["C10"] == pytest.approx(c10, abs=3.0)


@pytest.mark.parametrize("phi12", [-1.2, -0.4, 0.4, 1.2])
def test_astigmatism_angle(phi12):
    """C12 = 30 Å at four directions: the fitted φ12 equals the truth modulo π, C12 in Å."""
    truth = {"C10": 40.0, "C12": 30.0, "phi12": phi12}
    got = _fit(simulate(truth))
    assert got["C10"] == pytest.approx(40.0, abs=3.0)
    assert got["C12"] == pytest.approx(30.0, abs=3.0)
    assert _angle_mod_pi(got["phi12"], phi12) < 0.1


def test_non_square_scan_both_orientations():
    """A 20 × 14 scan (rows > columns; the other tests use 16 × 20): same truth recovered."""
    truth = {"C10": -50.0, "C12": 25.0, "phi12": 0.9}
    got = _fit(simulate(truth, scan=(20, 14)))
    assert got["C10"] == pytest.approx(-50.0, abs=3.0)
    assert got["C12"] == pytest.approx(25.0, abs=3.0)
    assert _angle_mod_pi(got["phi12"], 0.9) < 0.1


def _dpc_geometry(detector: str):
    """``dpc.run`` on an in-focus acquisition with the same detector geometry (how the
    rotation is calibrated: DPC's rotation is least biased without aberrations)."""
    d = dpc.run(io.load(simulate({}, detector=detector), backend="cpu"))
    return d.rotation_deg, d.transpose


def test_rotated_detector_with_dpc_rotation():
    """Every frame rotated by 90° (``np.rot90``) on the detector: ``dpc.run`` finds 270°
    (mod 360°, its 180° ambiguity resolved), and SSB given that rotation recovers C10, C12 and
    φ12 in the scan frame. The rotation's 180° matters for SSB: ``k → −k`` flips the sign of
    the even aberrations the fit finds (C10 → −C10, φ12 → φ12 ± π/2)."""
    truth = {"C10": 40.0, "C12": 30.0, "phi12": 0.4}
    rot, transpose = _dpc_geometry("rot90")
    assert not transpose
    assert abs((rot % 360.0) - 270.0) < 3.0, rot
    counts = simulate(truth, detector="rot90")
    got = _fit(counts, rotation_deg=rot)
    assert got["C10"] == pytest.approx(40.0, abs=3.0)
    assert got["C12"] == pytest.approx(30.0, abs=3.0)
    assert _angle_mod_pi(got["phi12"], 0.4) < 0.1
    flipped = _fit(counts, rotation_deg=rot + 180.0)
    assert flipped["C10"] == pytest.approx(-40.0, abs=3.0)
    assert _angle_mod_pi(flipped["phi12"], 0.4 + math.pi / 2) < 0.1


def test_transposed_detector_with_dpc_geometry():
    """Frame axes exchanged: ``dpc.run`` reports ``transpose``, and SSB given its rotation and
    transpose recovers the truth; the reconstruction equals that of the frames with their axes
    exchanged back (the same BF pixels, the same probe vectors), and without ``transpose`` the
    fit is wrong (a reflection is not a rotation)."""
    truth = {"C10": 40.0, "C12": 30.0, "phi12": 0.4}
    rot, transpose = _dpc_geometry("transpose")
    assert transpose
    assert abs(((rot + 180.0) % 360.0) - 180.0) < 3.0, rot
    counts = simulate(truth, detector="transpose")
    got = _fit(counts, rotation_deg=rot, transpose=True)
    assert got["C10"] == pytest.approx(40.0, abs=3.0)
    assert got["C12"] == pytest.approx(30.0, abs=3.0)
    assert _angle_mod_pi(got["phi12"], 0.4) < 0.1
    wrong = _fit(counts, rotation_deg=rot)
    assert _angle_mod_pi(wrong["phi12"], 0.4) > 0.3 or abs(wrong["C12"] - 30.0) > 6.0, wrong

    swapped = np.ascontiguousarray(np.swapaxes(counts, 2, 3))
    kw = dict(voltage_kv=VOLTAGE_KV, semiangle_mrad=SEMIANGLE_MRAD, scan_step_a=STEP_A)
    kw["det_sampling_mrad"] = DTHETA
    a = ssb.SSB(io.load(counts, backend="cpu"), **kw, transpose=True)
    b = ssb.SSB(io.load(swapped, backend="cpu"), **kw)
    assert a.info["params"]["transpose"] is True and b.info["params"]["transpose"] is False
    oa, ob = a.reconstruct(truth).object, b.reconstruct(truth).object
    assert np.linalg.norm(oa - ob) <= 1e-9 * np.linalg.norm(ob)
    oc = ssb.SSB(io.load(counts, backend="cpu"), **kw).reconstruct(truth).object
    assert np.linalg.norm(oc - ob) > 1e-3 * np.linalg.norm(ob)


def test_c10_at_the_entrance_surface():
    """``fit(thickness_a=t)``: C10 referred to the entrance surface is the fitted C10 minus t
    (``fitted_plane="exit"``, the default for a strongly scattering crystal) or minus t/2
    (``fitted_plane="mid"``, kinematic); the fitted aberrations themselves are unchanged."""
    counts = simulate({"C10": 60.0}, scan=(12, 12))
    s = ssb.SSB(
        io.load(counts, backend="cpu"),
        voltage_kv=VOLTAGE_KV,
        semiangle_mrad=SEMIANGLE_MRAD,
        scan_step_a=STEP_A,
        det_sampling_mrad=DTHETA,
    )
    kw = dict(seed=0, fit=("C10",), global_evals=6, local_max_iter=10)
    plain = s.fit(**kw)
    assert "focal_reference" not in plain.provenance
    exit_ = s.fit(**kw, thickness_a=12.5)
    mid = s.fit(**kw, thickness_a=12.5, fitted_plane="mid")
    c10 = plain.aberrations["C10"]
    assert exit_.aberrations == plain.aberrations == mid.aberrations
    assert exit_.provenance["focal_reference"]["C10_entrance_a"] == pytest.approx(c10 - 12.5)
    assert mid.provenance["focal_reference"]["C10_entrance_a"] == pytest.approx(c10 - 6.25)
    assert exit_.provenance["focal_reference"]["fitted_plane"] == "exit"
    with pytest.raises(ValueError, match="thickness_a"):
        s.fit(**kw, thickness_a=-1.0)
    with pytest.raises(ValueError, match="fitted_plane"):
        s.fit(**kw, thickness_a=1.0, fitted_plane="entrance")
