"""Independent NumPy float64 references, shared by the tests and the bench scripts.

Nothing here imports quantem: these are the expected values the engine is compared with, and the
simulations that make its inputs. ``bench/dpc_abtem_validation.py`` imports this file too (by
path), so it needs NumPy only.
"""

from __future__ import annotations

import math

import numpy as np

# CODATA 2018, as anchor §7.
_H, _M0, _E, _C = 6.62607015e-34, 9.1093837015e-31, 1.602176634e-19, 299792458.0


def wavelength_a(kv: float) -> float:
    """Relativistic electron wavelength (Å) at ``kv`` kilovolts."""
    v = kv * 1e3
    return _H / math.sqrt(2 * _M0 * _E * v * (1 + _E * v / (2 * _M0 * _C**2))) * 1e10


def idpc(g_row, g_col):
    """Periodic least-squares inverse gradient, numpy FFT: ``φ^ = −i (ν·g^) / (2π |ν|²)``,
    ``ν`` in cycles per scan step, DC = 0."""
    nr, nc = g_row.shape
    vr = np.fft.fftfreq(nr)[:, None]
    vc = np.fft.fftfreq(nc)[None, :]
    d = vr**2 + vc**2
    d[0, 0] = 1.0
    ph = -1j * (vr * np.fft.fft2(g_row) + vc * np.fft.fft2(g_col)) / (2 * np.pi * d)
    ph[0, 0] = 0.0
    return np.fft.ifft2(ph).real


def centred_probe(window, dx, lam, semiangle_mrad, chi) -> np.ndarray:
    """The aberrated probe ``IFFT(A·exp(−iχ))`` on ``window``² pixels of ``dx`` Å, centred in the
    window (so that the window's object patch surrounds the scan position): ``A`` the hard
    aperture ``λ|k| ≤ α``, ``chi(kr, kc)`` χ in rad at spatial frequency ``(kr, kc)`` [Å⁻¹]."""
    f = np.fft.fftfreq(window, d=dx)
    kr, kc = np.meshgrid(f, f, indexing="ij")
    aperture = (lam * np.hypot(kr, kc) <= semiangle_mrad * 1e-3).astype(np.float64)
    return np.fft.fftshift(np.fft.ifft2(aperture * np.exp(-1j * chi(kr, kc))))


def periodic_bumps(shape, bumps) -> np.ndarray:
    """Sum of Gaussian bumps ``exp(−d²/2w²)`` on a periodic grid of ``shape`` pixels, for each
    ``(row, col, w)`` of ``bumps``; ``d`` is the distance wrapped around the grid."""
    gr, gc = shape
    r, c = np.mgrid[:gr, :gc].astype(np.float64)
    v = np.zeros((gr, gc))
    for r0, c0, w in bumps:
        dr = (r - r0 + gr / 2) % gr - gr / 2  # periodic distance
        dc = (c - c0 + gc / 2) % gc - gc / 2
        v += np.exp(-(dr**2 + dc**2) / (2 * w * w))
    return v


def scanned_frames(probe, transmission, scan, step_px, det) -> np.ndarray:
    """Far-field intensities ``|FFT(probe · t_R)|²`` (float64 ``scan + det``): ``probe`` is
    centred in its square window, ``t_R`` the window of ``transmission`` (periodic) around scan
    position ``R = step_px · (i, j)``, and each frame is cropped to the central ``det`` pixels."""
    m = probe.shape[0]
    gr, gc = transmission.shape
    lo_r, lo_c = (m - det[0]) // 2, (m - det[1]) // 2
    out = np.empty(tuple(scan) + tuple(det))
    idx = np.arange(m) - m // 2
    for i in range(scan[0]):
        rows = (i * step_px + idx) % gr
        for j in range(scan[1]):
            cols = (j * step_px + idx) % gc
            exit_wave = probe * transmission[np.ix_(rows, cols)]
            dp = np.abs(np.fft.fftshift(np.fft.fft2(exit_wave))) ** 2
            out[i, j] = dp[lo_r : lo_r + det[0], lo_c : lo_c + det[1]]
    return out
