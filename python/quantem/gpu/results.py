"""Axes, units and files of results: calibrated axes, TIFF and EMD (HDF5) writers, scale bars.

Every result (:class:`~quantem.gpu.detector.DetectorImage`, :class:`~quantem.gpu.detector.Products`,
:class:`~quantem.gpu.dpc.CoM`, :class:`~quantem.gpu.dpc.DPCResult`,
:class:`~quantem.gpu.ssb.SSBResult`, :class:`~quantem.gpu.ssb.SSBFit`) carries

* ``axes``: one :class:`Axis` per array dimension (scan axes ``R_r``/``R_c`` in Å when the scan
  step is known, detector axes ``k_r``/``k_c`` in mrad when the detector sampling is known,
  else both in pixels with scale 1), and
* ``units``: the unit of each array it holds, by attribute name,

and ``save(path)``: ``.tif``/``.tiff`` writes one image with its calibration in the TIFF
resolution tags and the ImageJ description; ``.h5``/``.hdf5``/``.emd`` writes every array in the
EMD 1.0 layout of ``emdfile`` (what py4DSTEM reads; hyperspy/rosettasciio read it too), with
its axes, units and the result's scalars and provenance.

The calibration comes from the dataset (``ds.calibration``: scan step and detector sampling)
when it records them, or from what the call was given (``det_sampling_mrad=``,
``scan_step_a=``); nothing is guessed.

Results asked for with ``device_result=True`` (CUDA datasets) hold :class:`DeviceArray`
objects in place of NumPy arrays: the same shapes, dtypes, axes, units and provenance, the
values in GPU memory. A ``DeviceArray`` exports them without a copy (``__dlpack__``,
``__dlpack_device__``, ``__cuda_array_interface__``), copies them only when asked
(``to_numpy()``) and refuses ``np.asarray``; ``save`` copies them to the host (writing a file
is a host operation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from quantem.gpu import _args, _native

__all__ = ["Axis", "DeviceArray", "add_scale_bar", "nice_scale_bar", "save"]

#: One result array in GPU memory (``device_result=True``): ``shape``, ``dtype``, ``device``
#: (CUDA ordinal), ``nbytes``, ``__dlpack__``/``__dlpack_device__`` (``(2, device)``),
#: ``__cuda_array_interface__``, ``to_numpy()``. An exported view keeps the memory alive after
#: the ``DeviceArray`` and the dataset are gone (docs/interop.md, "Device results").
DeviceArray = _native.DeviceArray

#: Units written for each axis unit in EMD files (py4DSTEM's spelling; rosettasciio reads
#: ``"A"`` as Å).
_EMD_UNITS = {"Å": "A", "px": "pixels"}

_TIFF_SUFFIXES = (".tif", ".tiff")
_EMD_SUFFIXES = (".h5", ".hdf5", ".emd")


@dataclass(frozen=True)
class Axis:
    """One calibrated axis of a result array.

    Attributes
    ----------
    name : str
        ``"R_r"``/``"R_c"`` (scan row/column), ``"k_r"``/``"k_c"`` (detector row/column) or
        ``"evaluation"``.
    size : int
        Number of samples.
    scale : float
        Step between samples, in ``units``.
    units : str
        ``"Å"``, ``"mrad"``, or ``"px"`` when the calibration is not known.
    offset : float
        Value of the first sample (0: axes start at pixel 0).
    """

    name: str
    size: int
    scale: float
    units: str
    offset: float = 0.0

    @property
    def calibrated(self) -> bool:
        """True when the axis is in a physical unit (not pixels)."""
        return self.units != "px"

    def values(self) -> np.ndarray:
        """The coordinate of every sample: ``offset + scale · i`` (float64)."""
        return self.offset + self.scale * np.arange(self.size, dtype=np.float64)

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, size={self.size}, scale={self.scale:.6g} {self.units})"


def _field(cal: Any, name: str) -> Any:
    if cal is None:
        return None
    if isinstance(cal, Mapping):
        return cal.get(name)
    return getattr(cal, name, None)


def _pair_or_none(v: Any) -> tuple[float, float] | None:
    """A positive finite scalar or ``(row, col)`` pair as a pair, else None."""
    if v is None or isinstance(v, (bool, str, bytes)):
        return None
    if isinstance(v, (int, float, np.integer, np.floating)):
        pair = (float(v), float(v))
    else:
        try:
            a, b = v
            pair = (float(a), float(b))
        except (TypeError, ValueError):
            return None
    if all(math.isfinite(x) and x > 0 for x in pair):
        return pair
    return None


def calibration(ds: Any) -> dict[str, tuple[float, float] | None]:
    """``scan_step_a`` and ``det_sampling_mrad`` (each a ``(row, col)`` pair or None) of the
    dataset: from ``ds.calibration`` where it has one, else from ``ds.metadata``
    (``scan_step_a``, ``angular_sampling_mrad``); None for what neither records."""
    out: dict[str, tuple[float, float] | None] = {}
    sources = []
    for attr in ("calibration", "metadata"):
        try:
            sources.append(getattr(ds, attr, None))
        except Exception:  # a closed dataset: pixels
            sources.append(None)
    for key, names in (
        ("scan_step_a", ("scan_step_a",)),
        ("det_sampling_mrad", ("det_sampling_mrad", "angular_sampling_mrad")),
    ):
        out[key] = None
        for src in sources:
            for n in names:
                v = _pair_or_none(_field(src, n))
                if v is not None and out[key] is None:
                    out[key] = v
    return out


def scan_axes(shape: Sequence[int], step_a: Any = None) -> tuple[Axis, Axis]:
    """Scan axes ``(R_r, R_c)`` in Å with ``step_a`` (scalar or pair), else in pixels."""
    step = _pair_or_none(step_a)
    if step is None:
        return (Axis("R_r", int(shape[0]), 1.0, "px"), Axis("R_c", int(shape[1]), 1.0, "px"))
    return (Axis("R_r", int(shape[0]), step[0], "Å"), Axis("R_c", int(shape[1]), step[1], "Å"))


def detector_axes(shape: Sequence[int], sampling_mrad: Any = None) -> tuple[Axis, Axis]:
    """Detector axes ``(k_r, k_c)`` in mrad with ``sampling_mrad``, else in pixels."""
    s = _pair_or_none(sampling_mrad)
    if s is None:
        return (Axis("k_r", int(shape[0]), 1.0, "px"), Axis("k_c", int(shape[1]), 1.0, "px"))
    return (Axis("k_r", int(shape[0]), s[0], "mrad"), Axis("k_c", int(shape[1]), s[1], "mrad"))


def dataset_axes(
    ds: Any, scan_step_a: Any = None, det_sampling_mrad: Any = None
) -> tuple[tuple[Axis, Axis], tuple[Axis, Axis]]:
    """Scan and detector axes of ``ds``: the given calibration first, then the dataset's."""
    cal = calibration(ds)
    shape = tuple(int(n) for n in ds.shape)
    step = _pair_or_none(scan_step_a) or cal["scan_step_a"]
    det = _pair_or_none(det_sampling_mrad) or cal["det_sampling_mrad"]
    return scan_axes(shape[:2], step), detector_axes(shape[2:], det)


def with_axes(result: Any, axes: tuple[Axis, ...], units: Mapping[str, str]) -> Any:
    """A copy of the frozen dataclass ``result`` with ``axes`` and ``units`` set."""
    return dataclasses.replace(result, axes=tuple(axes), units=dict(units))


#: Units of the values of each product of :func:`quantem.gpu.detector.products` (CoM: its
#: own ``unit``; detector images: counts).
_PRODUCT_UNITS = {
    "sum_dp": "counts",
    "mean_dp": "counts",
    "max_dp": "counts",
    "moments": "counts",
}


def products_axes(
    items: Mapping[str, Any], scan: tuple[Axis, Axis], det: tuple[Axis, Axis]
) -> tuple[dict[str, tuple[Axis, ...]], dict[str, str]]:
    """Axes and value units of each product by name (detector patterns on the detector axes,
    everything else on the scan axes)."""
    axes: dict[str, tuple[Axis, ...]] = {}
    units: dict[str, str] = {}
    for name, value in items.items():
        axes[name] = det if name in ("sum_dp", "mean_dp", "max_dp") else scan
        if name == "com":
            units[name] = value.unit
        elif name == "moments":
            units[name] = "counts (sum), counts·px (m_row, m_col)"  # each array's in the file
        else:
            units[name] = _PRODUCT_UNITS.get(name, "counts")
    return axes, units


# --- scale bars ---------------------------------------------------------------------------


def nice_scale_bar(
    scale: float, units: str, n_pixels: int, fraction: float = 0.2
) -> tuple[float, float, str]:
    """A scale bar for an axis of ``n_pixels`` samples ``scale`` ``units`` apart.

    The bar's length is the largest 1, 2 or 5 × 10ⁿ (in ``units``) that spans at most
    ``fraction`` of the axis, or at most one sample when a sample is longer than that.
    ``quantem-gpu``'s PNGs use the same rule.

    Returns
    -------
    (length, length_px, label)
        ``length`` in ``units``; ``length / scale``, the bar's length in samples (a float:
        draw it as ``round(length_px · zoom)`` display pixels); and the label (``"2 nm"``,
        ``"50 mrad"``, ``"10 px"``: Å from 10 Å on are written in nm).
    """
    if not (math.isfinite(scale) and scale > 0 and n_pixels > 0):
        raise _args.invalid(
            "scale bar",
            "the axis needs a positive scale and size",
            "scale > 0, n_pixels > 0",
            f"scale={scale!r}, n_pixels={n_pixels!r}",
        )
    target = max(scale, fraction * n_pixels * scale)
    base = 10.0 ** math.floor(math.log10(target))
    length = next(m * base for m in (5.0, 2.0, 1.0) if m * base <= target * (1 + 1e-9))
    return length, length / scale, _bar_label(length, units)


def add_scale_bar(ax: Any, axis: Axis, *, fraction: float = 0.2, color: str = "white") -> Any:
    """Draw a :func:`nice_scale_bar` for ``axis`` (the image's column axis) on the matplotlib
    axes ``ax`` showing the image with ``imshow`` (one data unit per sample); returns the
    artist (matplotlib's ``AnchoredSizeBar``, over the lower-left corner of the image).

    The ``.show()`` helpers call it with the result's ``axes[1]``; pair it with
    ``fig.colorbar`` for the values.
    """
    from mpl_toolkits.axes_grid1.anchored_artists import AnchoredSizeBar

    _, length_px, label = nice_scale_bar(axis.scale, axis.units, axis.size, fraction)
    bar = AnchoredSizeBar(
        ax.transData,
        length_px,
        label,
        "lower left",
        pad=0.4,
        color=color,
        frameon=False,
        size_vertical=max(axis.size / 100.0, 0.5),
    )
    ax.add_artist(bar)
    return bar


def _bar_label(length: float, units: str) -> str:
    if units == "Å" and length >= 10.0:
        return f"{_number_text(length / 10.0)} nm"
    return f"{_number_text(length)} {units}"


def _number_text(v: float) -> str:
    return f"{v:.6g}"


# --- device results ------------------------------------------------------------------------


def _host(v: Any) -> np.ndarray:
    """``v`` as a host array: a :class:`DeviceArray` copied (``to_numpy()``), anything else
    through ``np.asarray``."""
    if isinstance(v, DeviceArray):
        return v.to_numpy()
    return np.asarray(v)


# --- what each result holds ----------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    name: str
    data: np.ndarray
    units: str
    axes: tuple[Axis, ...]


def _items(result: Any) -> tuple[list[_Item], dict[str, Any]]:
    """The arrays of ``result`` (with units and axes) and its scalars (for metadata)."""
    from quantem.gpu.detector import DetectorImage, Products
    from quantem.gpu.dpc import CoM, DPCResult
    from quantem.gpu.ssb import SSBFit, SSBResult

    if isinstance(result, Products):
        items: list[_Item] = []
        scalars: dict[str, Any] = {}
        for name, value in result.items():
            if isinstance(value, (DetectorImage, CoM)):
                sub, sub_scalars = _items(value)
                items.extend(sub)
                scalars.update({f"{name}.{k}": v for k, v in sub_scalars.items()})
            elif isinstance(value, Mapping):  # moments: sum, m_row, m_col
                for k, v in value.items():
                    u = "counts" if k == "sum" else "counts·px"
                    items.append(_Item(f"{name}_{k}", _host(v), u, result.axes.get(name, ())))
            else:
                items.append(
                    _Item(
                        name,
                        _host(value),
                        result.units.get(name, ""),
                        result.axes.get(name, ()),
                    )
                )
        if result.disk is not None:
            scalars.update(_disk_scalars(result.disk))
        return items, scalars
    if isinstance(result, SSBFit):
        items, scalars = _items(result.result)
        items.append(
            _Item(
                "loss_curve",
                np.asarray(result.loss_curve),
                "",
                (Axis("evaluation", len(result.loss_curve), 1.0, "px"),),
            )
        )
        scalars.update(
            loss=result.loss,
            evaluations=result.evaluations,
            objective=result.objective,
            fitted=",".join(result.fitted),
        )
        return items, scalars
    names = {
        DetectorImage: ("image",),
        CoM: ("com_row", "com_col"),
        DPCResult: ("phase", "com_row", "com_col", "dpc_row", "dpc_col"),
        SSBResult: ("phase", "weak_phase", "amplitude", "object"),
    }.get(type(result))
    if names is None:
        raise _args.wrong_type(
            "save",
            "save takes a result of quantem.gpu",
            "DetectorImage, Products, CoM, DPCResult, SSBResult or SSBFit",
            result,
        )
    items = []
    for n in names:
        label = result.kind if isinstance(result, DetectorImage) else n
        items.append(_Item(label, _host(getattr(result, n)), result.units.get(n, ""), result.axes))
    scalars = {}
    for f in dataclasses.fields(result):
        v = getattr(result, f.name)
        if isinstance(v, (bool, int, float, str, np.integer, np.floating)):
            scalars[f.name] = v
    if isinstance(result, DetectorImage):
        scalars.update(_disk_scalars(result.disk))
    if isinstance(result, SSBResult):
        scalars.update({f"aberrations.{k}": v for k, v in result.aberrations.items()})
    return items, scalars


def _disk_scalars(disk: Any) -> dict[str, Any]:
    return {
        "disk.center_row_px": disk.center_px[0],
        "disk.center_col_px": disk.center_px[1],
        "disk.radius_px": disk.radius_px,
        "disk.fitted": disk.fitted,
    }


# --- writers -------------------------------------------------------------------------------


def save(result: Any, path: str | os.PathLike[str], which: str | None = None) -> str:
    """Write ``result`` to ``path``; the suffix picks the format.

    ``.tif``/``.tiff``: one 2-D image (``which`` names it; default the result's main image:
    the detector image, the phase of DPC and SSB), ImageJ-compatible: uint8 and uint16 stay,
    integers that fit uint16 are written as uint16, other values as float32 (integers above
    2²⁴ then round; the EMD file keeps every value exactly). Scan axes are written in nm
    (resolution = pixels per nm, ImageJ ``unit=nm``), detector axes in mrad; uncalibrated
    axes get no resolution.

    ``.h5``/``.hdf5``/``.emd``: every array of the result in the EMD 1.0 layout (``emdfile``,
    read by py4DSTEM and by hyperspy/rosettasciio's EMD reader), each with its dims (start,
    step), their names and units, and its value units; the result's scalars and its
    provenance (JSON) under the root's metadata. An existing file is replaced.

    Returns
    -------
    str
        The path written.
    """
    p = os.fspath(_args.path("save", "path", path))
    suffix = os.path.splitext(p)[1].lower()
    items, scalars = _items(result)
    if suffix in _TIFF_SUFFIXES:
        _write_tiff(p, _pick(items, which, result))
    elif suffix in _EMD_SUFFIXES:
        if which is not None:
            items = [_pick(items, which, result)]
        _write_emd(p, items, scalars, getattr(result, "provenance", {}))
    else:
        raise _args.invalid(
            "save",
            f"unknown result file suffix of {p}",
            ", ".join(_TIFF_SUFFIXES + _EMD_SUFFIXES),
            repr(suffix) if suffix else "no suffix",
        )
    return p


def _pick(items: list[_Item], which: str | None, result: Any) -> _Item:
    images = [i for i in items if i.data.ndim == 2]
    if which is None:
        if not images:
            raise _args.invalid("save", "the result holds no 2-D image", "an image", "none")
        from quantem.gpu.detector import Products
        from quantem.gpu.dpc import CoM

        if isinstance(result, (Products, CoM)) and len(images) > 1:
            raise _args.invalid(
                "save",
                "a TIFF holds one image: name it with which=",
                ", ".join(i.name for i in images),
                "which=None",
            )
        return images[0]
    for i in items:
        if i.name == which:
            if i.data.ndim != 2 and i.data.dtype.kind != "c":
                break
            return i
    raise _args.invalid(
        "save", "which= names no image of the result", ", ".join(i.name for i in images), which
    )


def _tiff_data(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "c":
        raise _args.invalid(
            "save", "a TIFF holds real values", "a real image (phase, amplitude)", str(a.dtype)
        )
    if a.dtype in (np.uint8, np.uint16, np.float32):
        return a
    if a.dtype.kind in "ui" and a.size and a.min() >= 0 and a.max() <= 65535:
        return a.astype(np.uint16)
    return a.astype(np.float32)


def _write_tiff(path: str, item: _Item) -> None:
    import tifffile

    data = _tiff_data(item.data)
    kwargs: dict[str, Any] = {}
    ax_r, ax_c = item.axes if len(item.axes) == 2 else (None, None)
    metadata: dict[str, Any] = {"axes": "YX"}
    if ax_r is not None and ax_r.units == ax_c.units and ax_r.calibrated:
        factor = 0.1 if ax_r.units == "Å" else 1.0  # Å -> nm
        unit = "nm" if ax_r.units == "Å" else ax_r.units
        kwargs["resolution"] = (1.0 / (ax_c.scale * factor), 1.0 / (ax_r.scale * factor))
        metadata["unit"] = unit
    if item.units:
        metadata["Info"] = f"values: {item.units}"
    tifffile.imwrite(path, data, imagej=True, metadata=metadata, **kwargs)


def _emd_units(u: str) -> str:
    return _EMD_UNITS.get(u, u)


def _write_emd(
    path: str, items: list[_Item], scalars: dict[str, Any], provenance: Mapping[str, Any]
) -> None:
    import h5py

    tmp = f"{path}.part-{uuid.uuid4().hex[:8]}"
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["emd_group_type"] = "file"
            f.attrs["version_major"] = 1
            f.attrs["version_minor"] = 0
            f.attrs["UUID"] = str(uuid.uuid4())
            f.attrs["authoring_program"] = "quantem.gpu"
            f.attrs["authoring_user"] = ""
            root = f.create_group("quantem")
            root.attrs["emd_group_type"] = "root"
            root.attrs["python_class"] = "Root"
            for it in items:
                g = root.create_group(it.name)
                g.attrs["emd_group_type"] = "array"
                g.attrs["python_class"] = "Array"
                d = g.create_dataset("data", data=it.data)
                d.attrs["units"] = it.units
                for n, ax in enumerate(it.axes):
                    dim = g.create_dataset(f"dim{n}", data=np.array([ax.offset, ax.scale]))
                    dim.attrs["name"] = ax.name
                    dim.attrs["units"] = _emd_units(ax.units)
            bundle = root.create_group("metadatabundle")
            bundle.attrs["emd_group_type"] = "metadatabundle"
            md = bundle.create_group("quantem")
            md.attrs["emd_group_type"] = "metadata"
            md.attrs["python_class"] = "Metadata"
            for k, v in scalars.items():
                _metadata_entry(md, k, v)
            _metadata_entry(md, "provenance", json.dumps(provenance, default=str))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _metadata_entry(group: Any, key: str, value: Any) -> None:
    if isinstance(value, (bool, np.bool_)):
        d = group.create_dataset(key, data=bool(value))
        d.attrs["type"] = "bool"
    elif isinstance(value, (int, float, np.integer, np.floating)):
        d = group.create_dataset(key, data=value)
        d.attrs["type"] = "number"
    else:
        d = group.create_dataset(key, data=str(value))
        d.attrs["type"] = "string"
