"""Centre of mass, differential phase contrast (DPC) and its integration (iDPC).

Definitions (``SCIENCE.md``): per frame the exact moments ``S = Σ I``, ``m_r = Σ k_r I``,
``m_c = Σ k_c I`` give the centre of mass ``μ = m / S`` in float64 (a frame with ``S = 0`` gives 0
and is counted in ``zero_frames``), in detector pixels from pixel (0, 0). The public CoM is
centred (the scan mean of each component removed) unless ``centered=False``.

:func:`run` finds the rotation between scan and detector (and whether the two CoM components are
exchanged, ``transpose``) by minimising the mean squared curl of the rotated field, resolves the
180° ambiguity by a stated criterion (``sign_criterion``, ``sign_confidence``, ``confident``), and
integrates the field into a phase with the least-squares inverse gradient
``φ̂ = −i (ν·ĝ) / (2π |ν|²)`` (ν in cycles per scan step, DC = 0).

>>> from quantem.gpu import io, dpc
>>> ds = io.load("scan_master.h5")
>>> res = dpc.run(ds)
>>> res.rotation_deg, res.transpose, res.phase.shape
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from quantem.gpu import _args, _display, _native, _progress, calibration, results
from quantem.gpu.detector import _invalid

__all__ = ["CoM", "DPCResult", "center_of_mass", "integrate", "run"]

_EDGES = ("periodic", "mirror")


def _shape(a: np.ndarray) -> str:
    return "(" + ", ".join(str(n) for n in a.shape) + ")"


# Scalar fields are cast to their annotated type; arrays and dicts are taken as they come.
_SCALARS = {"float": float, "bool": bool, "int": int, "str": str}


def _from_fields(cls, d: dict[str, Any]):
    """An instance of the dataclass ``cls`` from the native dict ``d``, field by field."""
    return cls(
        **{f.name: _SCALARS.get(f.type, lambda v: v)(d[f.name]) for f in fields(cls) if f.name in d}
    )


class _Arrays:
    """What :class:`CoM` and :class:`DPCResult` share: construction from the engine's dict,
    ``save``, and notebook display."""

    @classmethod
    def _from_native(cls, d: dict[str, Any]):
        return _from_fields(cls, d)

    def save(self, path, which: str | None = None) -> str:
        """Write the arrays as EMD/HDF5 (``.h5``, ``.emd``) or one image as TIFF (``.tif``;
        ``which=`` names it); see :func:`quantem.gpu.results.save`. Returns the path."""
        return results.save(self, path, which)

    _repr_html_ = _display.result_html
    show = _display.show


@dataclass(frozen=True, repr=False)
class CoM(_Arrays):
    """Centre of mass per scan position.

    Attributes
    ----------
    com_row, com_col : numpy.ndarray or DeviceArray
        ``float64`` ``(R_r, R_c)``: the CoM components, in ``unit`` (``DeviceArray`` s with
        ``device_result=True``).
    zero_frames : int
        Frames whose counts sum to 0 (their CoM is 0).
    centered : bool
        True when the scan mean of each component was removed.
    unit : str
        ``"px"`` (detector pixels) or ``"mrad"``.
    provenance : dict
    """

    com_row: np.ndarray
    com_col: np.ndarray
    zero_frames: int
    centered: bool = True
    unit: str = "px"
    provenance: dict[str, Any] = field(default_factory=dict)
    #: Scan axes ``(R_r, R_c)`` (Å when the scan step is known, else px).
    axes: tuple[results.Axis, ...] = ()
    #: Unit of each array: ``{"com_row": unit, "com_col": unit}``.
    units: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"CoM(com_row={_shape(self.com_row)}, com_col={_shape(self.com_col)}, "
            f"unit={self.unit!r}, centered={self.centered}, zero_frames={self.zero_frames})"
        )


@dataclass(frozen=True, repr=False)
class DPCResult(_Arrays):
    """What :func:`run` returns.

    Attributes
    ----------
    com_row, com_col : numpy.ndarray
        ``float64`` ``(R_r, R_c)``: the centred CoM, as measured (before rotation).
    rotation_deg : float
        Rotation from detector to scan axes, degrees (given, or found by the curl search).
    transpose : bool
        Whether the CoM components were exchanged before the rotation.
    sign_confidence : float
        How strongly the 180° criterion preferred the chosen sign (see ``sign_criterion``).
    sign_criterion : str
        The physical criterion that fixed the 180° ambiguity.
    confident : bool
        False when the criterion could not decide: the sign may then be wrong.
    dpc_row, dpc_col : numpy.ndarray
        ``float64`` ``(R_r, R_c)``: the rotated field, the phase gradient that was integrated.
    phase : numpy.ndarray
        ``float64`` ``(R_r, R_c)``: the integrated phase (iDPC), mean 0.
    curl_score : float
        Mean squared curl of the rotated field (lower is better).
    provenance : dict
    """

    com_row: np.ndarray
    com_col: np.ndarray
    rotation_deg: float
    transpose: bool
    sign_confidence: float
    sign_criterion: str
    confident: bool
    dpc_row: np.ndarray
    dpc_col: np.ndarray
    phase: np.ndarray
    curl_score: float = float("nan")
    provenance: dict[str, Any] = field(default_factory=dict)
    #: Scan axes ``(R_r, R_c)`` of every array (Å when the scan step is known, else px).
    axes: tuple[results.Axis, ...] = ()
    #: Unit of each array: CoM and DPC fields in ``"px"`` or ``"mrad"``, ``phase`` in ``"rad"``
    #: when the field is calibrated, else in "CoM unit × scan step" (e.g. ``"px·scan step"``).
    units: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"DPCResult(phase={_shape(self.phase)}, rotation_deg={self.rotation_deg:.3f}, "
            f"transpose={self.transpose}, sign_confidence={self.sign_confidence:.3g}, "
            f"confident={self.confident}, curl_score={self.curl_score:.3g})"
        )


def _edge(edge: str, op: str = "dpc") -> str:
    return _args.text(op, "edge", edge, _EDGES)


def center_of_mass(ds, centered: bool = True, progress=None, *, device_result: bool = False) -> CoM:
    """Centre of mass of every frame, in detector pixels (mrad with a detector sampling in
    ``ds.calibration``: the file's, or the one the user set).

    Parameters
    ----------
    centered : bool
        Remove the scan mean of each component (zero frames included in the mean).
    progress : None, True or callable
        ``True`` draws a tqdm bar of frames (rate, ETA; ``tqdm.auto``); a callable gets
        ``(stage, done, total)`` on the calling thread.
    device_result : bool
        ``True`` leaves ``com_row``/``com_col`` in GPU memory as ``float64``
        :class:`~quantem.gpu.results.DeviceArray` s, computed on the card from the exact
        moments: the host values bit for bit (CUDA datasets only; docs/interop.md).

    Returns
    -------
    CoM
    """
    op = "dpc.center_of_mass"
    _args.dataset(op, ds)
    flag = _args.flag(op, "centered", centered)
    dev = _args.flag(op, "device_result", device_result)
    native = _native.dpc_center_of_mass
    d = _progress.run(op, progress, lambda cb: native(ds, flag, progress=cb, device_result=dev))
    com = CoM._from_native(calibration.dpc_rescale(d, ds.calibration, op))
    scan, _ = results.dataset_axes(ds)
    return results.with_axes(com, scan, {"com_row": com.unit, "com_col": com.unit})


def run(
    ds,
    rotation_deg: float | None = None,
    transpose: bool | None = None,
    edge: str = "periodic",
    progress=None,
) -> DPCResult:
    """DPC: the CoM field rotated onto the scan axes and integrated into a phase.

    Parameters
    ----------
    rotation_deg : float, optional
        The scan–detector rotation; when omitted, ``ds.calibration.rotation_deg`` where the
        user set it, else found by minimising the mean squared curl.
    transpose : bool, optional
        Whether to exchange the CoM components; found with the rotation when omitted (False
        when ``rotation_deg`` is given and this is not).
    edge : {"periodic", "mirror"}
        Edge handling of the integration: periodic, or mirrored padding.
    progress : None, True or callable
        ``True`` draws a tqdm bar of the pass over the frames (rate, ETA; ``tqdm.auto``); a
        callable gets ``(stage, done, total)`` on the calling thread.

    Returns
    -------
    DPCResult

    Notes
    -----
    The units follow ``ds.calibration``: CoM and field in mrad with a detector sampling,
    the phase in rad with the voltage and scan step too (the file's values are read by the
    engine; values the user set are applied to its result, see
    :func:`quantem.gpu.calibration.dpc_rescale`).

    On a CUDA dataset every stage runs on the card (CoM, rotation search, cuFFT integration,
    sign) and the arrays are downloaded once; ``provenance["params"]["stages_on"]`` says where
    they ran. The results equal the CPU engine's (the phase to rounding of the transforms).
    """
    op = "dpc.run"
    _args.dataset(op, ds)
    rot = _args.optional_number(op, "rotation_deg", rotation_deg)
    cal = ds.calibration
    if rot is None:
        rot = cal.given("rotation_deg")
    tr = _args.optional_flag(op, "transpose", transpose)
    ed = _edge(edge, op)
    d = _progress.run(
        op,
        progress,
        lambda cb: _native.dpc_run(ds, rotation_deg=rot, transpose=tr, edge=ed, progress=cb),
    )
    d = calibration.dpc_rescale(d, cal, op)
    scan, _ = results.dataset_axes(ds)
    unit = str(d.get("unit", "px"))
    units = {n: unit for n in ("com_row", "com_col", "dpc_row", "dpc_col")}
    units["phase"] = str(d.get("phase_unit", "a.u."))
    return results.with_axes(DPCResult._from_native(d), scan, units)


def integrate(g_row, g_col, edge: str = "periodic") -> np.ndarray:
    """Phase ``φ`` whose gradient is closest (least squares) to ``(g_row, g_col)``.

    ``φ̂ = −i (ν·ĝ) / (2π |ν|²)`` with ν in cycles per scan step; the mean of ``φ`` is 0. A
    gradient in radians per scan step gives a phase in radians.

    Parameters
    ----------
    g_row, g_col : array_like (R_r, R_c)
        Gradient components along scan rows and columns (same shape, 2-D).
    edge : {"periodic", "mirror"}
        Treat the field as periodic, or pad it by mirroring first.

    Returns
    -------
    numpy.ndarray
        ``float64`` ``(R_r, R_c)``.
    """
    op = "dpc.integrate"
    edge = _edge(edge, op)
    fields = []
    for name, g in (("g_row", g_row), ("g_col", g_col)):
        a = np.asarray(g)
        if a.dtype.kind not in "biuf":
            raise _invalid(
                op,
                f"{name} must be a real array",
                expected="float (R_r, R_c)",
                found=f"dtype {a.dtype} shape {_shape(a)}",
            )
        a = np.ascontiguousarray(a, dtype=np.float64)
        if not np.isfinite(a).all():
            raise _invalid(
                op,
                f"{name} holds NaN or inf",
                expected="finite values",
                found=f"{int((~np.isfinite(a)).sum())} non-finite of {a.size}",
            )
        fields.append(a)
    gr, gc = fields
    if gr.ndim != 2 or gr.shape != gc.shape:
        raise _invalid(
            "dpc.integrate",
            "g_row and g_col must be 2-D arrays of the same shape",
            expected="two (R_r, R_c) arrays",
            found=f"{_shape(gr)} and {_shape(gc)}",
        )
    return _native.dpc_integrate(gr, gc, edge)
