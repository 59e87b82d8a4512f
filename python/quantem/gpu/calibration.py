"""A dataset's calibration as typed fields: ``ds.calibration``.

>>> ds = io.load("scan_master.h5")
>>> ds.calibration
Calibration(scan_step_a=(0.4, 0.4) Å [metadata], det_sampling_mrad=None [default], ...)
>>> ds.calibration = ds.calibration.replace(scan_step_a=0.41, rotation_deg=-12.0)
>>> ds.calibration.source("scan_step_a")
'argument'
>>> s = ssb.SSB(ds)                 # voltage, α, steps, rotation: ds.calibration
>>> del ds.calibration              # back to what the file says

Fields (each ``None`` where nobody says):

* ``scan_step_a``: scan step ``(row, col)``, Å;
* ``det_sampling_mrad``: detector angular sampling ``(row, col)``, mrad per *loaded* pixel
  (after ``det_bin``);
* ``voltage_kv``: accelerating voltage, kV (the file's ``energy_ev`` / 1000, else from its
  electron wavelength);
* ``semiangle_mrad``: probe-forming (convergence) semi-angle α, mrad;
* ``rotation_deg``: scan–detector rotation, degrees, in the convention of
  :func:`quantem.gpu.dpc.run` (no reader records it yet: it comes from the user).

Each has a source, :meth:`Calibration.source`: ``"argument"`` (set by the user),
``"metadata"`` (read from the file) or ``"default"`` (unknown: the engine's default applies —
pixels for the axes, ``α / r_edge`` for the detector sampling, the curl search for the DPC
rotation, 0 for SSB's).

The engine's rule (``qem::calibration``) is *argument > file metadata > α / r_edge*. The
Python calls pass the user's values (source ``"argument"``) to the engine as explicit
arguments, so they win over the file: :mod:`~quantem.gpu.detector` with ``unit="mrad"``
(``semiangle_mrad``, ``det_sampling_mrad``), :func:`quantem.gpu.dpc.run` (``rotation_deg``; CoM,
field and phase units rescaled from what the engine read, see :func:`dpc_rescale`) and
:func:`quantem.gpu.dpc.center_of_mass`, and the result axes. ``SSB`` takes what
its call leaves out from ``ds.calibration.ssb_arguments()``. An argument given to a call still
wins over ``ds.calibration``.

The native ``Dataset`` holds no Python attributes, so the user's calibration is kept in a
per-process table beside it (checked against the dataset's load record, so a later dataset
never inherits another's), and a pickled dataset carries it to the process that reopens it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantem.gpu import _args, _native

__all__ = ["FIELDS", "SOURCES", "Calibration", "electron_wavelength_a", "of"]

#: The calibration fields, in order.
FIELDS = ("scan_step_a", "det_sampling_mrad", "voltage_kv", "semiangle_mrad", "rotation_deg")
#: What :meth:`Calibration.source` answers.
SOURCES = ("argument", "metadata", "default")

_PAIRS = ("scan_step_a", "det_sampling_mrad")
_UNITS = {
    "scan_step_a": "Å",
    "det_sampling_mrad": "mrad/px",
    "voltage_kv": "kV",
    "semiangle_mrad": "mrad",
    "rotation_deg": "°",
}
_OP = "calibration"

# CODATA 2018 (exact SI values but the electron mass).
_H, _M0, _E, _C = 6.62607015e-34, 9.1093837015e-31, 1.602176634e-19, 299792458.0


def electron_wavelength_a(voltage_kv: float) -> float:
    """Relativistic electron wavelength (Å) at ``voltage_kv``:
    ``λ = h / √(2 m e V (1 + e V / (2 m c²)))``."""
    v = voltage_kv * 1e3
    return _H / math.sqrt(2 * _M0 * _E * v * (1 + _E * v / (2 * _M0 * _C**2))) * 1e10


def _voltage_kv_from_wavelength(lambda_a: float) -> float:
    p = _H / (lambda_a * 1e-10)
    mc2 = _M0 * _C * _C
    return (math.sqrt((p * _C) ** 2 + mc2 * mc2) - mc2) / _E / 1e3


def _check(name: str, value: Any) -> Any:
    """``value`` checked for field ``name``: a pair of finite numbers > 0 for the steps and
    samplings (a scalar means both), a finite number > 0 for voltage and semi-angle, any
    finite number for the rotation; None stays None."""
    if value is None:
        return None
    if name in _PAIRS:
        if _args._is_real(value):
            v = _args.number(_OP, name, value, positive=True)
            return (v, v)
        items = _args._items(_OP, name, value, 2, "a number > 0 or (row, col)")
        return tuple(
            _args.number(_OP, f"{name}[{i}]", x, positive=True) for i, x in enumerate(items)
        )
    return _args.number(_OP, name, value, positive=name != "rotation_deg")


@dataclass(frozen=True, repr=False)
class Calibration:
    """A dataset's calibration; see the module documentation.

    Construct it with the values you know (each checked: a wrong type raises
    :class:`~quantem.gpu.ArgumentTypeError`, a negative, zero or non-finite value
    :class:`~quantem.gpu.InvalidArgumentError`, both naming the field), or take
    ``ds.calibration`` and :meth:`replace` what you know better. Values given this way have
    the source ``"argument"``.

    Attributes
    ----------
    scan_step_a, det_sampling_mrad : (float, float) or None
        ``(row, col)``; a scalar given is used for both.
    voltage_kv, semiangle_mrad, rotation_deg : float or None
    sources : dict
        ``{field: "argument" | "metadata" | "default"}``.
    """

    scan_step_a: tuple[float, float] | None = None
    det_sampling_mrad: tuple[float, float] | None = None
    voltage_kv: float | None = None
    semiangle_mrad: float | None = None
    rotation_deg: float | None = None
    sources: Mapping[str, str] | None = field(default=None, compare=False)
    #: What the file says (the values ``None`` falls back to when set on a dataset).
    _file: Calibration | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = self.sources or {}
        sources = {}
        for name in FIELDS:
            v = _check(name, getattr(self, name))
            object.__setattr__(self, name, v)
            src = given.get(name, "argument" if v is not None else "default")
            if src not in SOURCES:
                raise _args.invalid(_OP, f"unknown source of {name}", ", ".join(SOURCES), src)
            sources[name] = src if v is not None else "default"
        object.__setattr__(self, "sources", sources)

    def source(self, name: str) -> str:
        """Where field ``name`` came from: ``"argument"``, ``"metadata"`` or ``"default"``."""
        if name not in FIELDS:
            raise _args.invalid(_OP, "unknown calibration field", ", ".join(FIELDS), repr(name))
        return self.sources[name]

    def replace(self, **changes: Any) -> Calibration:
        """A copy with ``changes`` (source ``"argument"``); ``None`` for a field goes back to
        what the file says (or the default)."""
        for k in changes:
            if k not in FIELDS:
                raise _args.wrong_type(
                    _OP,
                    f"replace() got an unknown field {k!r}",
                    ", ".join(FIELDS),
                    changes[k],
                )
        values = {n: getattr(self, n) for n in FIELDS}
        sources = dict(self.sources)
        for k, v in changes.items():
            if v is None:
                base = self._file
                values[k] = None if base is None else getattr(base, k)
                sources[k] = "default" if base is None else base.sources[k]
            else:
                values[k] = _check(k, v)
                sources[k] = "argument"
        return Calibration(**values, sources=sources, _file=self._file)

    def given(self, name: str) -> Any:
        """The value of ``name`` when the user set it (source ``"argument"``), else None."""
        return getattr(self, name) if self.source(name) == "argument" else None

    def ssb_arguments(self) -> dict[str, Any]:
        """Keyword arguments for :class:`quantem.gpu.ssb.SSB`: voltage, semi-angle and scan
        step where known, the detector sampling and rotation where the user set them (the
        engine reads the file's detector sampling itself; SSB's rotation default is 0)."""
        out: dict[str, Any] = {}
        for n in ("voltage_kv", "semiangle_mrad", "scan_step_a"):
            if getattr(self, n) is not None:
                out[n] = getattr(self, n)
        if self.given("det_sampling_mrad") is not None:
            r, c = self.det_sampling_mrad
            if r != c:
                raise _args.invalid(
                    "calibration.ssb_arguments",
                    "SSB takes one detector sampling: det_sampling_mrad differs along rows "
                    "and columns",
                    "equal (row, col) det_sampling_mrad",
                    repr((r, c)),
                )
            out["det_sampling_mrad"] = r
        if self.rotation_deg is not None:
            out["rotation_deg"] = self.rotation_deg
        return out

    def as_dict(self) -> dict[str, Any]:
        """``{field: {"value": ..., "unit": ..., "source": ...}}`` (for provenance and JSON)."""
        return {
            n: {
                "value": None if getattr(self, n) is None else _plain(getattr(self, n)),
                "unit": _UNITS[n],
                "source": self.sources[n],
            }
            for n in FIELDS
        }

    def __repr__(self) -> str:
        parts = []
        for n in FIELDS:
            v = getattr(self, n)
            text = "None" if v is None else f"{_plain(v)} {_UNITS[n]}"
            parts.append(f"{n}={text} [{self.sources[n]}]")
        return "Calibration(" + ", ".join(parts) + ")"

    def _repr_html_(self) -> str:
        from quantem.gpu import _display

        rows = [
            (n, f"{'—' if d['value'] is None else d['value']} {d['unit']} ({d['source']})")
            for n, d in self.as_dict().items()
        ]
        return _display.table_html("Calibration", rows)


def _plain(v: Any) -> Any:
    return tuple(float(x) for x in v) if isinstance(v, tuple) else float(v)


def _positive(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def _positive_pair(v: Any) -> tuple[float, float] | None:
    if v is None or isinstance(v, (str, bytes)):
        return None
    try:
        a, b = v
    except (TypeError, ValueError):
        return None
    a, b = _positive(a), _positive(b)
    return None if a is None or b is None else (a, b)


def from_metadata(md: Mapping[str, Any]) -> Calibration:
    """The calibration a dataset's ``metadata`` gives (the rule of ``qem::calibration``:
    voltage from ``energy_ev``, else from ``wavelength_a``; positive finite values only)."""
    values: dict[str, Any] = {}
    energy = _positive(md.get("energy_ev"))
    lam = _positive(md.get("wavelength_a"))
    if energy is not None:
        values["voltage_kv"] = energy / 1e3
    elif lam is not None:
        values["voltage_kv"] = _voltage_kv_from_wavelength(lam)
    values["semiangle_mrad"] = _positive(md.get("semiangle_mrad"))
    values["scan_step_a"] = _positive_pair(md.get("scan_step_a"))
    values["det_sampling_mrad"] = _positive_pair(md.get("angular_sampling_mrad"))
    sources = {n: "metadata" for n, v in values.items() if v is not None}
    return Calibration(**values, sources=sources)


# ----------------------------------------------------------------------------- ds.calibration

#: ``id(ds) -> (load record, Calibration)`` of the datasets whose calibration the user set.
_TABLE: dict[int, tuple[str, Calibration]] = {}


def _record(ds) -> str:
    """What tells this dataset from a later one at the same address: its load record (the
    provenance's stage times, with nanosecond resolution, and its files)."""
    p = ds.provenance
    return repr((p.get("timings"), p.get("files"), tuple(ds.shape)))


def of(ds) -> Calibration:
    """``ds.calibration``: the user's calibration where set, else the file's."""
    entry = _TABLE.get(id(ds))
    if entry is not None:
        if entry[0] == _record(ds):
            return entry[1]
        del _TABLE[id(ds)]  # a dataset since collected: not this one's
    cal = from_metadata(ds.metadata)
    return dataclasses.replace(cal, sources=cal.sources, _file=cal)


def set_on(ds, value: Calibration) -> None:
    """``ds.calibration = value``: ``None`` fields of ``value`` take the file's values."""
    if not isinstance(value, Calibration):
        raise _args.wrong_type(
            _OP,
            "ds.calibration must be a Calibration",
            "ds.calibration.replace(...) or calibration.Calibration(...)",
            value,
        )
    file_cal = from_metadata(ds.metadata)
    values, sources = {}, {}
    for n in FIELDS:
        v = getattr(value, n)
        if v is None:
            values[n], sources[n] = getattr(file_cal, n), file_cal.sources[n]
        else:
            values[n], sources[n] = v, value.sources[n]
    merged = Calibration(**values, sources=sources, _file=file_cal)
    if all(merged.sources[n] != "argument" for n in FIELDS):
        _TABLE.pop(id(ds), None)
        return
    _TABLE[id(ds)] = (_record(ds), merged)


def reset(ds) -> None:
    """``del ds.calibration``: back to what the file says."""
    _TABLE.pop(id(ds), None)


def user_values(ds) -> dict[str, Any]:
    """The fields the user set on ``ds`` (what a pickled dataset carries)."""
    cal = of(ds)
    return {n: _plain(getattr(cal, n)) for n in FIELDS if cal.source(n) == "argument"}


def _install() -> None:
    _native.Dataset.calibration = property(
        of,
        set_on,
        reset,
        doc="The calibration (:class:`quantem.gpu.calibration.Calibration`): from the file's "
        "metadata, settable (``ds.calibration = ds.calibration.replace(scan_step_a=0.4)``), "
        "``del ds.calibration`` to go back to the file's.",
    )


_install()


# ----------------------------------------------------------------------------- DPC units


def _pair_or_none(v: Any) -> tuple[float, float] | None:
    return None if v is None else (float(v[0]), float(v[1]))


def _times(v: Any, a: float) -> Any:
    """``v * a``; a device result (``device_result=True``) is multiplied on the card, one IEEE
    multiply per value as NumPy's, so both forms keep the same values."""
    if isinstance(v, _native.DeviceArray):
        return v._scaled(a)
    return np.asarray(v) * a


def dpc_rescale(native: dict[str, Any], cal: Calibration, op: str) -> dict[str, Any]:
    """The native CoM/DPC dict in the units of ``cal`` where the user set a detector
    sampling, voltage or scan step the engine (which reads the file) did not use.

    The engine records what it used (``provenance.params.calibration``). The CoM and the
    rotated field scale by ``s_user / s_used`` (``s_used`` = 1 in pixels); the phase is the
    linear inverse gradient of ``K ⊙ field`` with ``K = 2π·10⁻³·step/λ`` per axis when all
    three are known (else 1), so it scales by the same factor times ``K_user / K_used`` — one
    number only when that ratio is equal along rows and columns (else
    :class:`~quantem.gpu.InvalidArgumentError` naming the field). The rotation search, the
    180° criterion and ``curl_score`` (the engine's is the same in pixels and in mrad) do not
    change under one positive factor. The provenance records both calibrations.
    """
    params = native.get("provenance", {}).get("params", {})
    used = params.get("calibration") or {}
    det_n = _pair_or_none(used.get("detector_angular_sampling_mrad"))
    lam_n = used.get("wavelength_a")
    step_n = _pair_or_none(used.get("scan_step_a"))
    det_u = cal.given("det_sampling_mrad") or det_n
    volt = cal.given("voltage_kv")
    lam_u = electron_wavelength_a(volt) if volt is not None else lam_n
    step_u = cal.given("scan_step_a") or step_n
    if (det_u, lam_u, step_u) == (det_n, lam_n, step_n):
        return native
    changed = det_u != det_n
    for name, pair in (("det_sampling_mrad", det_u), ("det_sampling_mrad (file)", det_n)):
        if changed and pair is not None and not math.isclose(pair[0], pair[1], rel_tol=1e-12):
            raise _args.invalid(
                op,
                "a detector sampling that differs along rows and columns cannot be applied "
                "after the engine's pass",
                f"equal (row, col) {name.split()[0]}",
                repr(pair),
            )
    a = 1.0 if not changed else det_u[0] / (1.0 if det_n is None else det_n[0])

    def k(det, lam, step):
        if det is None or lam is None or step is None:
            return (1.0, 1.0)
        return (2 * math.pi * 1e-3 * step[0] / lam, 2 * math.pi * 1e-3 * step[1] / lam)

    k_n, k_u = k(det_n, lam_n, step_n), k(det_u, lam_u, step_u)
    b_r, b_c = k_u[0] / k_n[0], k_u[1] / k_n[1]
    if "phase" in native and not math.isclose(b_r, b_c, rel_tol=1e-12):
        raise _args.invalid(
            op,
            "the phase in rad needs the same scan-step change along rows and columns when "
            "the calibration differs from the file's",
            "scan_step_a with equal (row, col), or the file's own scan step",
            repr(step_u),
        )
    out = dict(native)
    for n in ("com_row", "com_col", "dpc_row", "dpc_col"):
        if n in out:
            out[n] = _times(out[n], a)
    unit = "mrad" if det_u is not None else "px"
    out["unit"] = unit
    if "phase" in out:
        out["phase"] = np.asarray(out["phase"]) * (a * b_r)
        full = det_u is not None and lam_u is not None and step_u is not None
        out["phase_unit"] = "rad" if full else f"{unit}·scan step"
    prov = dict(out.get("provenance", {}))
    prov["calibration_applied"] = {
        "rule": "ds.calibration (argument) over the file's metadata, applied after the pass",
        "engine_used": {
            "detector_angular_sampling_mrad": det_n,
            "wavelength_a": lam_n,
            "scan_step_a": step_n,
        },
        "applied": {
            "detector_angular_sampling_mrad": det_u,
            "wavelength_a": lam_u,
            "scan_step_a": step_u,
        },
        "field_factor": a,
        "phase_factor": a * b_r,
    }
    out["provenance"] = prov
    return out
