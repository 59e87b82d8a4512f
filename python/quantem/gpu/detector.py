"""Detector products of a loaded dataset: diffraction sums, virtual detectors, moments.

Every integer product is exact: sums accumulate in 64 bits, so ``sum_dp``, virtual images of
bool/integer masks, the ``bf``/``adf``/... images and the moments are ``uint64`` arrays equal to a
float-free NumPy reference. Each call is one pass over the frames on the dataset's backend (CPU
or CUDA, DENSE or ENCODED); :func:`products` computes several products in that one pass.

Definitions (``SCIENCE.md``): a detector pixel ``k = (k_r, k_c)`` belongs to the annulus
``[lo, hi]`` around the centre ``c`` when ``lo² ≤ |k − c|² ≤ hi²`` (float64, both bounds
inclusive). BF is ``[0, r]``, ABF ``[r/2, r]``, ADF ``[r, 2r]``, HAADF ``[2r, 4r]``, DF
``[r, ∞)``, where the BF disk (centre ``c``, radius ``r``) is fitted from the mean diffraction
pattern (threshold at mean + std, unweighted centroid, equal-area radius) unless ``center=`` and
``radius=`` are given.

>>> from quantem.gpu import io, detector
>>> ds = io.load("scan_master.h5")
>>> adf = detector.adf(ds)                  # inner/outer default to [r, 2r]
>>> img = np.asarray(adf)                   # uint64 (R_r, R_c)
>>> out = detector.products(ds, ["bf", "adf", "com", "sum_dp"])   # one pass

On a CUDA dataset ``device_result=True`` leaves the arrays in GPU memory: a
:class:`~quantem.gpu.results.DeviceArray` (``__dlpack__``, ``__cuda_array_interface__``,
``.to_numpy()``) in place of each NumPy array, the rest of the result (bounds, disk, axes,
units, provenance) unchanged; on a CPU dataset it raises ``InvalidArgumentError``
(docs/interop.md, "Device results"):

>>> bf = detector.bf(ds, device_result=True)
>>> t = torch.from_dlpack(bf)               # a view of bf.image on cuda:N, no copy
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantem.gpu import _args, _display, _native, _progress, results
from quantem.gpu.results import DeviceArray

__all__ = [
    "DetectorImage",
    "DiskFit",
    "Products",
    "abf",
    "adf",
    "annular",
    "bf",
    "df",
    "fit_disk",
    "frames",
    "haadf",
    "max_dp",
    "mean_dp",
    "moments",
    "products",
    "roi_dp",
    "sum_dp",
    "virtual_image",
]

#: Product names accepted by :func:`products`.
PRODUCT_NAMES = (
    "bf",
    "abf",
    "adf",
    "haadf",
    "df",
    "annular",
    "sum_dp",
    "mean_dp",
    "max_dp",
    "moments",
    "com",
)

_DETECTOR_KINDS = ("bf", "abf", "adf", "haadf", "df", "annular")


#: An :class:`~quantem.gpu.InvalidArgumentError` shaped like the engine's own errors.
_invalid = _args.invalid


def _shape(a: np.ndarray) -> str:
    return "(" + ", ".join(str(n) for n in a.shape) + ")"


@dataclass(frozen=True, repr=False)
class DiskFit:
    """The bright-field disk used by the virtual detectors.

    Attributes
    ----------
    center_px : (float, float)
        Centre ``(row, col)`` in detector pixels (sub-pixel).
    radius_px : float
        Radius in detector pixels.
    threshold : float
        The mean-DP threshold ``mean + std`` of the fit (NaN when both centre and radius were
        given, so no fit ran).
    n_pixels : int
        Mean-DP pixels above the threshold (0 when none: the fit then falls back to the
        detector centre and a quarter of the short side).
    fitted : bool
        True when the disk came from the fit, False when ``center=``/``radius=`` overrode it.
    """

    center_px: tuple[float, float]
    radius_px: float
    threshold: float
    n_pixels: int
    fitted: bool

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> DiskFit:
        return cls(
            center_px=(float(d["center_px"][0]), float(d["center_px"][1])),
            radius_px=float(d["radius_px"]),
            threshold=float(d["threshold"]),
            n_pixels=int(d["n_pixels"]),
            fitted=bool(d["fitted"]),
        )

    def __repr__(self) -> str:
        r, c = self.center_px
        how = f"fitted, {self.n_pixels} px above {self.threshold:.4g}" if self.fitted else "given"
        return f"DiskFit(center_px=({r:.3f}, {c:.3f}), radius_px={self.radius_px:.3f}, {how})"


@dataclass(frozen=True, repr=False)
class DetectorImage:
    """One virtual-detector image (``bf``, ``abf``, ``adf``, ``haadf``, ``df`` or ``annular``).

    ``np.asarray(result)`` is :attr:`image`. With ``device_result=True`` the image is a
    :class:`~quantem.gpu.results.DeviceArray` in GPU memory: ``np.asarray`` then raises
    ``TypeError`` (no implicit copy), ``torch.from_dlpack(result)`` /
    ``cupy.from_dlpack(result)`` / ``cupy.asarray(result)`` view it without a copy, and
    :meth:`to_host` makes the host result.

    Attributes
    ----------
    kind : str
        The detector (``"bf"``, ``"adf"``, ...).
    image : numpy.ndarray or DeviceArray
        ``uint64`` ``(R_r, R_c)``: the exact sum of the counts inside the annulus per frame
        (a :class:`~quantem.gpu.results.DeviceArray` with ``device_result=True``).
    inner_px, outer_px : float
        The annulus bounds actually used, in detector pixels (``outer_px`` is ``inf`` for DF).
    center : (float, float)
        The annulus centre ``(row, col)`` used, in detector pixels.
    radius : float
        The BF-disk radius ``r`` the default bounds were derived from, in detector pixels.
    disk : DiskFit
        The disk (fitted or given).
    mask_pixels : int
        Detector pixels inside the annulus.
    provenance : dict
        Operation, resolved parameters, backend, device, stage times and the dataset's own
        provenance.
    """

    kind: str
    image: np.ndarray
    inner_px: float
    outer_px: float
    center: tuple[float, float]
    radius: float
    disk: DiskFit
    mask_pixels: int
    provenance: dict[str, Any] = field(default_factory=dict)
    #: Scan axes ``(R_r, R_c)`` of :attr:`image` (Å when the scan step is known, else px).
    axes: tuple[results.Axis, ...] = ()
    #: Unit of each array: ``{"image": "counts"}``.
    units: dict[str, str] = field(default_factory=dict)

    def save(self, path, which: str | None = None) -> str:
        """Write the image as TIFF (``.tif``) or EMD/HDF5 (``.h5``, ``.emd``) with its axes
        (see :func:`quantem.gpu.results.save`); returns the path."""
        return results.save(self, path, which)

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> DetectorImage:
        disk = DiskFit._from_native(d["disk"])
        outer = d["outer_px"]
        return cls(
            kind=str(d["kind"]),
            image=d["image"],
            inner_px=float(d["inner_px"]),
            outer_px=float("inf") if outer is None else float(outer),
            center=disk.center_px,
            radius=disk.radius_px,
            disk=disk,
            mask_pixels=int(d["mask_pixels"]),
            provenance=d["provenance"],
        )

    @property
    def on_device(self) -> bool:
        """True when :attr:`image` lives in GPU memory (``device_result=True``)."""
        return isinstance(self.image, DeviceArray)

    def to_host(self) -> DetectorImage:
        """This result with its image on the host (a copy of a device image; ``self`` when it
        is on the host already)."""
        if not self.on_device:
            return self
        return dataclasses.replace(self, image=self.image.to_numpy())

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The device image's CUDA Array Interface (``cupy.asarray(result)``); absent for a
        host image."""
        if not self.on_device:
            raise AttributeError(
                "__cuda_array_interface__: this DetectorImage's image is on the host (NumPy); "
                "ask for device_result=True on a CUDA dataset for a device image"
            )
        return self.image.__cuda_array_interface__

    def __array__(self, dtype=None, copy=None):
        if self.on_device:
            raise TypeError(
                f"this DetectorImage's image lives on cuda:{self.image.device} "
                "(device_result=True): no implicit copy to the host; use result.to_host() or "
                "result.image.to_numpy(), or torch/cupy.from_dlpack(result) for a device view"
            )
        if copy is False:
            # The image is a numpy array already; a view of it is what "no copy" means.
            return self.image if dtype is None else self.image.astype(dtype, copy=False)
        a = self.image if dtype is None else self.image.astype(dtype)
        return np.array(a, copy=True) if copy else a

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :attr:`image`, ``(R_r, R_c)``."""
        return self.image.shape

    def _repr_html_(self) -> str:
        return _display.result_html(self)  # a device image: listed where it lives, no thumbnail

    def show(self, *args, **kwargs):
        """Plot the image with matplotlib (a device image is copied to the host for it, as
        plotting needs); returns the ``Axes``."""
        return _display.show(self.to_host(), *args, **kwargs)

    def __repr__(self) -> str:
        r, c = self.center
        where = f" on cuda:{self.image.device}" if self.on_device else ""
        return (
            f"DetectorImage(kind={self.kind!r}, image={_shape(self.image)} {self.image.dtype}"
            f"{where}, inner_px={self.inner_px:.3f}, outer_px={self.outer_px:.3f}, "
            f"center=({r:.3f}, {c:.3f}), radius={self.radius:.3f}, "
            f"mask_pixels={self.mask_pixels})"
        )


class Products(dict):
    """What :func:`products` returns: a dict ``name → result`` with two extra attributes.

    Values: :class:`DetectorImage` for detectors, ``numpy.ndarray`` for ``sum_dp`` (uint64),
    ``mean_dp`` (float32) and ``max_dp`` (uint32), a dict of uint64 arrays for ``moments``, a
    :class:`quantem.gpu.dpc.CoM` for ``com``. With ``device_result=True`` every array is a
    :class:`~quantem.gpu.results.DeviceArray` (the CoM's two included).

    Attributes
    ----------
    disk : DiskFit or None
        The disk the detectors used (None when no detector was asked for).
    provenance : dict
        The provenance of the one pass.
    """

    disk: DiskFit | None
    provenance: dict[str, Any]
    #: Axes of each product by name: scan ``(R_r, R_c)`` or detector ``(k_r, k_c)``.
    axes: dict[str, tuple[results.Axis, ...]]
    #: Unit of each product's values by name (``"counts"``, ``"px"``, ...).
    units: dict[str, str]

    def __init__(
        self,
        items,
        disk: DiskFit | None,
        provenance: dict[str, Any],
        axes: dict[str, tuple[results.Axis, ...]] | None = None,
        units: dict[str, str] | None = None,
    ):
        super().__init__(items)
        self.disk = disk
        self.provenance = provenance
        self.axes = dict(axes or {})
        self.units = dict(units or {})

    def save(self, path, which: str | None = None) -> str:
        """Write the products as EMD/HDF5 (``.h5``, ``.emd``: every array) or one of them as
        TIFF (``.tif``, ``which=`` names it); see :func:`quantem.gpu.results.save`."""
        return results.save(self, path, which)

    _repr_html_ = _display.products_html

    def __repr__(self) -> str:
        return f"Products({list(self)}, disk={self.disk!r})"


def _det_shape(ds) -> tuple[int, int]:
    return (int(ds.shape[2]), int(ds.shape[3]))


def _device_flag(op: str, device_result) -> bool:
    return _args.flag(op, "device_result", device_result)


def _whole_scan(op: str, native, ds, device_result):
    """``native(ds, device_result=...)`` for a reduction over every frame (``sum_dp``,
    ``mean_dp``, ``max_dp``, ``moments``): ``device_result`` and then ``ds`` checked, errors
    naming ``op``."""
    on_device = _device_flag(op, device_result)
    return native(_args.dataset(op, ds), device_result=on_device)


def sum_dp(ds, *, device_result: bool = False) -> np.ndarray | DeviceArray:
    """Exact sum of every frame: ``uint64`` ``(k_r, k_c)``.

    Parameters
    ----------
    device_result : bool
        ``True`` leaves the sum in GPU memory as a :class:`~quantem.gpu.results.DeviceArray`
        (CUDA datasets only; see the module notes).
    """
    return _whole_scan("detector.sum_dp", _native.detector_sum_dp, ds, device_result)


def mean_dp(ds, *, device_result: bool = False) -> np.ndarray | DeviceArray:
    """Mean diffraction pattern: the exact uint64 sum divided by the frame count in float64,
    returned as ``float32`` ``(k_r, k_c)``.

    Parameters
    ----------
    device_result : bool
        ``True`` leaves the mean in GPU memory as a ``float32``
        :class:`~quantem.gpu.results.DeviceArray`, divided on the card: the host values bit
        for bit (CUDA datasets only; see the module notes).
    """
    return _whole_scan("detector.mean_dp", _native.detector_mean_dp, ds, device_result)


def max_dp(ds, *, device_result: bool = False) -> np.ndarray | DeviceArray:
    """Element-wise maximum over every frame: ``uint32`` ``(k_r, k_c)`` (exact).

    Parameters
    ----------
    device_result : bool
        ``True`` leaves the maximum in GPU memory as a
        :class:`~quantem.gpu.results.DeviceArray` (CUDA datasets only; see the module notes).
    """
    return _whole_scan("detector.max_dp", _native.detector_max_dp, ds, device_result)


def fit_disk(ds) -> DiskFit:
    """The bright-field disk fitted from the mean diffraction pattern (cached per dataset)."""
    return DiskFit._from_native(_native.detector_fit_disk(_args.dataset("detector.fit_disk", ds)))


def _positions(op: str, positions: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    if isinstance(positions, (str, bytes)) or not isinstance(positions, (Iterable, np.ndarray)):
        raise _args.wrong_type(op, "positions must be a sequence", "[(row, col), ...]", positions)
    out = []
    for i, p in enumerate(positions):
        r, c = _args._items(op, f"positions[{i}]", p, 2, "(row, col)")
        out.append(
            (
                _args.integer(op, f"positions[{i}] row", r, minimum=0),
                _args.integer(op, f"positions[{i}] column", c, minimum=0),
            )
        )
    return out


def frames(ds, positions: Iterable[Sequence[int]]) -> np.ndarray:
    """The frames at scan positions ``[(row, col), ...]``: ``(n, k_r, k_c)`` in the dataset's dtype.

    Positions are 0-based and must lie inside the scan (no negative indices).
    """
    op = "detector.frames"
    return _native.detector_frames(_args.dataset(op, ds), _positions(op, positions))


def roi_dp(
    ds,
    rect: Sequence[int] | None = None,
    circle: Sequence[float] | None = None,
    positions: Iterable[Sequence[int]] | None = None,
    reduce: str = "sum",
) -> np.ndarray:
    """Diffraction pattern over a region of scan positions.

    Give exactly one of ``rect``, ``circle`` and ``positions``.

    Parameters
    ----------
    rect : (int, int, int, int), optional
        Half-open scan region ``(row_start, row_stop, col_start, col_stop)``.
    circle : (float, float, float), optional
        ``(center_row, center_col, radius)`` in scan positions: the positions ``(r, c)`` with
        ``(r − center_row)² + (c − center_col)² ≤ radius²``.
    positions : list of (int, int), optional
        Explicit scan positions (each counted once).
    reduce : {"sum", "mean", "max"}
        ``"sum"``: exact ``uint64``; ``"mean"``: the sum divided by the number of positions
        (float64 division, returned as ``float32``, as :func:`mean_dp`); ``"max"``: ``uint32``.

    Returns
    -------
    numpy.ndarray
        ``(k_r, k_c)``.
    """
    op = "detector.roi_dp"
    _args.dataset(op, ds)
    given = [x is not None for x in (rect, circle, positions)]
    if sum(given) != 1:
        raise _invalid(
            "detector.roi_dp",
            "give exactly one scan region",
            "one of rect=, circle=, positions=",
            f"{sum(given)} of them",
        )
    reduce = _args.text(op, "reduce", reduce, ("sum", "mean", "max"))
    if rect is not None:
        res = _native.detector_roi_dp(ds, rect=_args.region(op, "rect", rect))
    elif circle is not None:
        r0, c0, radius = _args._items(op, "circle", circle, 3, "(center_row, center_col, radius)")
        res = _native.detector_roi_dp(
            ds,
            circle=[
                _args.number(op, "circle center_row", r0),
                _args.number(op, "circle center_col", c0),
                _args.number(op, "circle radius", radius, minimum=0.0),
            ],
        )
    else:
        res = _native.detector_roi_dp(ds, positions=_positions(op, positions))
    if reduce == "sum":
        return res["sum"]
    if reduce == "max":
        return res["max"]
    return (res["sum"].astype(np.float64) / float(res["n_frames"])).astype(np.float32)


def _mask_array(mask, det: tuple[int, int]) -> np.ndarray:
    m = np.asarray(mask)
    if m.dtype.kind == "b":
        return np.ascontiguousarray(m, dtype=np.uint64)
    if m.dtype.kind == "u":
        return np.ascontiguousarray(m, dtype=np.uint64)
    if m.dtype.kind == "i":
        return np.ascontiguousarray(m, dtype=np.int64)
    if m.dtype.kind == "f":
        return np.ascontiguousarray(m, dtype=np.float64)
    raise TypeError(
        f"a detector mask must be bool, integer or float {det}, not dtype {m.dtype} "
        f"(shape {_shape(m)})"
    )


def virtual_image(ds, mask, *, device_result: bool = False) -> np.ndarray | DeviceArray:
    """Virtual image ``V[R] = Σ_k mask[k] · I[R, k]`` for a mask over the detector.

    Parameters
    ----------
    mask : numpy.ndarray (k_r, k_c)
        bool or non-negative integer weights (at most 65535) give an exact ``uint64`` image;
        float weights give a ``float64`` image. Its shape must equal the detector's.
    device_result : bool
        ``True`` leaves the image in GPU memory (CUDA datasets only): a
        :class:`~quantem.gpu.results.DeviceArray`. On a CPU dataset it raises
        ``InvalidArgumentError``.

    Returns
    -------
    numpy.ndarray or DeviceArray
        ``(R_r, R_c)``.

    Raises
    ------
    InvalidArgumentError
        (a ``ValueError``) for a mask of the wrong shape, a negative or too large integer
        weight, or a non-finite float weight; the message names what was expected and found.
    """
    op = "detector.virtual_image"
    _args.dataset(op, ds)
    on_device = _device_flag(op, device_result)
    return _native.detector_virtual_image(
        ds, _mask_array(mask, _det_shape(ds)), device_result=on_device
    )


def _geometry(
    op: str, inner, outer, center, radius, unit, semiangle_mrad, det_sampling_mrad, ds=None
) -> dict[str, Any]:
    """The checked detector geometry, as the one dict the native detector calls take.

    With ``unit="mrad"``, a semi-angle or detector sampling the user set in
    ``ds.calibration`` is passed as the argument where the call gave none (the engine reads
    the file's values itself)."""
    lo = _args.optional_number(op, "inner", inner, minimum=0.0)
    hi = _args.optional_number(op, "outer", outer, minimum=0.0)
    if lo is not None and hi is not None and lo > hi:
        raise _invalid(
            op, "inner is larger than outer", "inner <= outer", f"inner={lo!r}, outer={hi!r}"
        )
    unit = _args.text(op, "unit", unit, ("px", "mrad"))
    if unit == "mrad" and ds is not None:
        cal = ds.calibration
        if semiangle_mrad is None:
            semiangle_mrad = cal.given("semiangle_mrad")
        if det_sampling_mrad is None and cal.given("det_sampling_mrad") is not None:
            r, c = cal.det_sampling_mrad
            if r != c:
                raise _invalid(
                    op,
                    "the detectors take one detector sampling: ds.calibration's "
                    "det_sampling_mrad differs along rows and columns",
                    "equal (row, col), or det_sampling_mrad=",
                    repr((r, c)),
                )
            det_sampling_mrad = r
    return dict(
        inner=lo,
        outer=hi,
        center=_args.pair(op, "center", center),
        radius=_args.optional_number(op, "radius", radius, positive=True),
        unit=unit,
        semiangle_mrad=_args.optional_number(op, "semiangle_mrad", semiangle_mrad, positive=True),
        det_sampling_mrad=_args.optional_number(
            op, "det_sampling_mrad", det_sampling_mrad, positive=True
        ),
    )


def _detector(kind: str, ds, geometry_args: tuple, progress, device_result):
    """One named detector; ``geometry_args`` are :func:`_geometry`'s ``inner`` to
    ``det_sampling_mrad``, in its order."""
    op = f"detector.{kind}"
    _args.dataset(op, ds)
    on_device = _device_flag(op, device_result)
    geometry = _geometry(op, *geometry_args, ds)
    native = _progress.run(
        op,
        progress,
        lambda cb: _native.detector_image(ds, kind, geometry, progress=cb, device_result=on_device),
    )
    img = DetectorImage._from_native(native)
    scan, _ = results.dataset_axes(ds)
    return results.with_axes(img, scan, {"image": "counts"})


_DETECTOR_DOC = """{title} image: the exact ``uint64`` sum over {what} per frame.

    Parameters
    ----------
    ds : Dataset
    inner, outer : float, optional
        Annulus bounds in ``unit``; {default}, from the BF-disk radius ``r``.
    center : (float, float), optional
        Disk centre ``(row, col)`` in detector pixels; default the fitted centre.
    radius : float, optional
        BF-disk radius ``r`` in detector pixels; default the fitted radius.
    unit : {{"px", "mrad"}}
        Unit of ``inner`` and ``outer``. ``"mrad"`` converts with the detector's angular
        sampling (``det_sampling_mrad``, else ``ds.calibration``'s: the one the user set, else
        the file's), else with ``semiangle_mrad`` (argument, ``ds.calibration``) over the BF
        disk radius: ``radius`` when given, else the sub-pixel disk edge that SSB also uses
        (docs/calibration.md; fitted once per dataset), or the threshold radius where the disk
        is too small for an edge (the provenance's ``sampling_source`` says which); with
        neither it raises ``InvalidArgumentError``.
    semiangle_mrad, det_sampling_mrad : float, optional
        Convergence semi-angle and detector sampling (mrad per pixel) for ``unit="mrad"``.
    progress : None, True or callable
        ``True`` draws a tqdm bar of frames (rate, ETA); a callable gets
        ``(stage, done, total)``; the pass then runs in blocks of frames (one block with
        ``device_result=True``).
    device_result : bool
        ``True`` leaves the image in GPU memory (CUDA datasets only): ``.image`` is a
        :class:`~quantem.gpu.results.DeviceArray` and the result exports it through
        ``__dlpack__`` / ``__cuda_array_interface__``; axes, units and provenance are as for a
        host image. On a CPU dataset it raises ``InvalidArgumentError``.

    Returns
    -------
    DetectorImage
        ``.image`` ``uint64`` ``(R_r, R_c)``; ``np.asarray(result)`` is the image (a host
        image; a device image is copied only by ``result.to_host()``).
    """


def _make_detector(kind: str, title: str, what: str, default: str):
    def fn(
        ds,
        inner: float | None = None,
        outer: float | None = None,
        center: Sequence[float] | None = None,
        radius: float | None = None,
        unit: str = "px",
        semiangle_mrad: float | None = None,
        det_sampling_mrad: float | None = None,
        progress=None,
        *,
        device_result: bool = False,
    ) -> DetectorImage:
        geometry_args = (inner, outer, center, radius, unit, semiangle_mrad, det_sampling_mrad)
        return _detector(kind, ds, geometry_args, progress, device_result)

    fn.__name__ = fn.__qualname__ = kind
    fn.__doc__ = _DETECTOR_DOC.format(title=title, what=what, default=default)
    return fn


bf = _make_detector("bf", "Bright-field", "the disk ``[0, r]``", "default ``[0, r]``")
abf = _make_detector("abf", "Annular bright-field", "``[r/2, r]``", "default ``[r/2, r]``")
adf = _make_detector("adf", "Annular dark-field", "``[r, 2r]``", "default ``[r, 2r]``")
haadf = _make_detector(
    "haadf", "High-angle annular dark-field", "``[2r, 4r]``", "default ``[2r, 4r]``"
)
df = _make_detector(
    "df", "Dark-field", "everything outside the disk, ``[r, ∞)``", "default ``[r, ∞)``"
)
annular = _make_detector(
    "annular", "Annular", "the annulus ``[inner, outer]``", "both required (no default)"
)


def moments(ds, *, device_result: bool = False) -> dict[str, np.ndarray | DeviceArray]:
    """Exact per-frame moments over the whole detector: ``dict(sum=, m_row=, m_col=)``.

    ``sum = Σ_k I``, ``m_row = Σ_k k_r I``, ``m_col = Σ_k k_c I``; each ``uint64`` ``(R_r, R_c)``.
    The centre of mass is ``m_row / sum`` (see :func:`quantem.gpu.dpc.center_of_mass`).

    Parameters
    ----------
    device_result : bool
        ``True`` leaves the three arrays in GPU memory as
        :class:`~quantem.gpu.results.DeviceArray` objects (CUDA datasets only; see the module
        notes).
    """
    return _whole_scan("detector.moments", _native.detector_moments, ds, device_result)


def products(
    ds,
    which: Sequence[str] | str,
    inner: float | None = None,
    outer: float | None = None,
    center: Sequence[float] | None = None,
    radius: float | None = None,
    unit: str = "px",
    semiangle_mrad: float | None = None,
    det_sampling_mrad: float | None = None,
    progress=None,
    *,
    device_result: bool = False,
) -> Products:
    """Several products in one pass over the frames.

    Parameters
    ----------
    which : list of str, or a comma-separated str
        Any of ``"bf", "abf", "adf", "haadf", "df", "annular", "sum_dp", "mean_dp", "max_dp",
        "moments", "com"``.
    inner, outer, center, radius, unit, semiangle_mrad, det_sampling_mrad
        As for :func:`adf`; they apply to every detector asked for. ``inner``/``outer`` are
        accepted only with exactly one detector (with several it is ambiguous which they mean:
        ``InvalidArgumentError``).
    progress : None, True or callable
        ``True`` draws a tqdm bar of frames per pass (rate, ETA); a callable gets
        ``(stage, done, total)``.
    device_result : bool
        ``True`` leaves every array in GPU memory (CUDA datasets only): detector images as
        :class:`DetectorImage` with a :class:`~quantem.gpu.results.DeviceArray` image,
        ``sum_dp``/``mean_dp``/``max_dp``, the ``moments`` arrays and the ``com`` components
        as ``DeviceArray`` (the mean and the CoM finished on the card from the pass's exact
        sums, the host values bit for bit). A CPU dataset raises ``InvalidArgumentError``.

    Returns
    -------
    Products
        A dict ``name → result`` (see :class:`Products`), with ``.disk`` and ``.provenance``.
    """
    from quantem.gpu.dpc import CoM

    op = "detector.products"
    _args.dataset(op, ds)
    on_device = _device_flag(op, device_result)
    if isinstance(which, str):
        names = [w.strip() for w in which.split(",")]
    elif isinstance(which, bytes) or not isinstance(which, Iterable):
        raise _args.wrong_type(op, "which must be product names", "a list of str or a str", which)
    else:
        names = list(which)
    for n in names:
        if not isinstance(n, str):
            raise _args.wrong_type(op, "a product name must be a str", "e.g. 'adf'", n)
    names = [n.lower() for n in names if n]
    unknown = [n for n in names if n not in PRODUCT_NAMES]
    if unknown:
        raise _invalid(
            "detector.products", "unknown product", ", ".join(PRODUCT_NAMES), ", ".join(unknown)
        )
    if not names:
        raise _invalid("detector.products", "nothing requested", "at least one product name")
    geometry = _geometry(
        op, inner, outer, center, radius, unit, semiangle_mrad, det_sampling_mrad, ds
    )
    res = _progress.run(
        op,
        progress,
        lambda cb: _native.detector_products(
            ds, names, geometry, progress=cb, device_result=on_device
        ),
    )
    items: dict[str, Any] = {}
    scan, det = results.dataset_axes(ds, det_sampling_mrad=geometry["det_sampling_mrad"])
    for d in res["images"]:
        img = results.with_axes(DetectorImage._from_native(d), scan, {"image": "counts"})
        items[img.kind] = img
    for name in ("sum_dp", "mean_dp", "max_dp", "moments"):
        if res.get(name) is not None:
            items[name] = res[name]
    if res.get("com") is not None:
        com = CoM._from_native(res["com"])
        items["com"] = results.with_axes(com, scan, {"com_row": com.unit, "com_col": com.unit})
    ordered = {n: items[n] for n in dict.fromkeys(names) if n in items}
    disk = None if res.get("disk") is None else DiskFit._from_native(res["disk"])
    axes, units = results.products_axes(ordered, scan, det)
    return Products(ordered, disk=disk, provenance=res["provenance"], axes=axes, units=units)
