"""Loading 4D-STEM acquisitions: Dectris master + shards, plain HDF5, numpy arrays.

Arrays are ``I[R_r, R_c, k_r, k_c]`` (scan row, scan column, detector row, detector column);
regions are half-open ``(row_start, row_stop, col_start, col_stop)``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from quantem.gpu import _args, _native, _progress
from quantem.gpu._enums import DataRepresentation

__all__ = [
    "DataRepresentation",
    "Dataset",
    "Dataset4dstemGPU",
    "discover",
    "inspect",
    "load",
    "save",
]

#: A loaded acquisition (returned by :func:`load`).
Dataset = _native.Dataset
#: The name users of quantem know for a GPU-resident dataset; the same class.
Dataset4dstemGPU = Dataset

ProgressCallback = _progress.ProgressCallback


_OP_LOAD = "load"

#: dtype names ``load`` takes (the engine's, lower case).
_DTYPE_NAMES = ("native", "u8", "u16", "u32", "uint8", "uint16", "uint32", "u8_saturating")


def _representation_name(representation) -> str | None:
    if representation is None:
        return None
    if isinstance(representation, DataRepresentation):
        return representation.value
    if isinstance(representation, str):
        return representation
    raise _args.wrong_type(
        _OP_LOAD,
        "representation must be a name or an io.DataRepresentation member",
        "'dense', 'encoded', an io.DataRepresentation member or None",
        representation,
    )


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "native"
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise _args.invalid(
                _OP_LOAD, "unknown dtype", "native, u8, u16 or u32 (or uint8/16/32)", repr(dtype)
            )
        return dtype.lower()
    if isinstance(dtype, (bool, int, float, bytes)):
        raise _args.wrong_type(
            _OP_LOAD,
            "dtype must be a name or a numpy dtype",
            "'native', 'u16', np.uint16, ...",
            dtype,
        )
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise _args.wrong_type(
            _OP_LOAD,
            "dtype must be a name or a numpy dtype",
            "'native', 'u16', np.uint16, ...",
            dtype,
        ) from None
    if name not in ("uint8", "uint16", "uint32"):
        raise _args.invalid(_OP_LOAD, "unsupported dtype", "uint8, uint16 or uint32", name)
    return name


def load(
    source: str | os.PathLike[str] | np.ndarray,
    backend: str = "auto",
    scan_shape: Sequence[int] | None = None,
    scan_region: Sequence[int] | None = None,
    detector_region: Sequence[int] | None = None,
    det_bin: int = 1,
    dtype: str | np.dtype | type = "native",
    representation: None | str | DataRepresentation = None,
    apply_mask: bool = True,
    memory_budget: int | None = None,
    progress: None | bool | ProgressCallback = None,
    dataset_path: str | None = None,
    device: int | None = None,
    format: str | None = None,
    shape: Sequence[int] | None = None,
    raw_dtype: str | None = None,
    file_header_bytes: int = 0,
    frame_header_bytes: int = 0,
    frame_footer_bytes: int = 0,
    float_scale: float | None = None,
) -> Dataset:
    """Load a 4D-STEM acquisition.

    The GIL is released while loading; Ctrl-C stops the load.

    Parameters
    ----------
    source : str, bytes, os.PathLike or numpy.ndarray
        A path (``bytes`` are decoded with ``os.fsdecode``) to a Dectris ``*_master.h5``, a
        plain HDF5 file with a 3-D ``(N, k_r, k_c)`` or 4-D dataset,
        a ``.qem`` file written by :func:`save` (recognised by its content; regions, binning and
        dtype changes are refused for it), or a uint8/uint16/uint32 array of shape
        ``(R_r, R_c, k_r, k_c)`` or ``(N, k_r, k_c)`` (copied).
    backend : {"auto", "cpu", "cuda", "mps"}
        ``"auto"`` picks CUDA when usable, else the CPU; an explicit backend that cannot run
        raises :class:`~quantem.gpu.BackendUnavailableError`.
    scan_shape : (int, int), optional
        ``(R_r, R_c)``; required when the source does not record it and ``N`` is not a square.
    scan_region, detector_region : (int, int, int, int), optional
        Half-open ``(row_start, row_stop, col_start, col_stop)``; only these are loaded. The
        detector region is in source pixels, applied before binning.
    det_bin : int
        Detector binning factor; edge blocks that do not fill a bin are summed over the pixels
        that exist (output size is the ceiling).
    dtype : {"native", "u16", "u32", "u8"} or numpy dtype
        ``"native"`` keeps the source dtype (widened to uint32 when binned sums can overflow);
        ``"u16"`` narrows only when every value fits (else
        :class:`~quantem.gpu.DtypeOverflowError`); ``"u8"`` saturates at 255 and records how many
        values were clipped in the provenance.
    representation : {"dense", "encoded"}, DataRepresentation or None
        ``None`` = the backend's default: DENSE on the CPU; ENCODED on CUDA when the result is
        uint16 (else DENSE). ENCODED holds every frame rANS-coded (``ds.nbytes_resident`` is
        the coded size; on CUDA it lives on the GPU, built batch by batch so the dense
        acquisition never exists there) and decodes on access; it holds counts up to 65535,
        so a uint32 result is refused (use ``dtype="u16"``); uint8 is coded widened (the same
        streams on both engines). A CuPy view
        (``__cuda_array_interface__``) needs ``representation="dense"``.
    apply_mask : bool
        Set the detector's bad pixels (``pixel_mask & 0xFFFF != 0``) to 0.
    memory_budget : int, optional
        Upper bound in bytes for the loaded data (else :class:`~quantem.gpu.MemoryBudgetError`).
    progress : None, True or callable
        ``True`` draws a ``tqdm`` bar per stage with rate and ETA (``tqdm.auto``: the widget
        in Jupyter, a text bar on standard error elsewhere); a callable is called as
        ``progress(stage, done, total)`` on the calling thread. An exception raised by it stops
        the load and propagates.
    dataset_path : str, optional
        Dataset inside a plain HDF5 file (when the file holds more than one candidate).
    device : int, optional
        CUDA device index (as this process sees it, after ``CUDA_VISIBLE_DEVICES``). A process
        uses one GPU: the first load that touches CUDA fixes it, and a later load naming
        another raises :class:`~quantem.gpu.InvalidArgumentError` (use one process, e.g. one
        Dask worker, per GPU: ``docs/distributed.md``). With ``backend="auto"`` a device index
        means CUDA; with ``"cpu"`` it is an ``InvalidArgumentError``; an index past the device
        count is an ``InvalidArgumentError``, no usable GPU a ``BackendUnavailableError``.
    format : str, optional
        ``None`` recognises the file by its content; else one of ``"hdf5"`` (Dectris, plain
        HDF5, hyperspy ``.hspy``, py4DSTEM/emdfile), ``"qem"``, ``"npy"``, ``"raw"``, ``"mib"``,
        ``"empad"``, ``"dm4"``. An unrecognised file raises a SourceError listing them
        (docs/formats.md).
    shape, raw_dtype, file_header_bytes, frame_header_bytes, frame_footer_bytes
        The layout of a generic raw binary file (``format="raw"``): ``shape`` ``(N, k_r, k_c)``
        or ``(R_r, R_c, k_r, k_c)``, ``raw_dtype`` the stored element type (``"uint16"``,
        ``"<u2"``, ``">u2"``, ``"float32"``...; ``dtype`` stays the result policy), bytes
        before the first frame and around each frame. The file size must match exactly.
    float_scale : float, optional
        Consent to read float32 (or Gatan float64) frames (gain-corrected, EMPAD) as counts:
        ``round(value / float_scale)``; values rounding below 0 read 0 (their number is in
        ``ds.metadata``); NaN/inf raise DecodeError. A float source without it is refused.

    Returns
    -------
    Dataset

    Raises
    ------
    SourceError, DecodeError, InvalidArgumentError, DtypeOverflowError, MemoryBudgetError,
    BackendUnavailableError, QuantemIOError
        Each names the operation, the file and frame where they apply, what was expected and
        what was found.
    ArgumentTypeError
        An argument of the wrong type (an ``InvalidArgumentError`` and a ``TypeError``):
        nothing is coerced, so ``det_bin=2.0`` or ``apply_mask="no"`` is refused, not read
        as 2 or True. Integers may be numpy integer scalars; flags ``bool`` or ``np.bool_``.
    """
    op = _OP_LOAD
    if isinstance(source, np.ndarray):
        src: Any = source
    elif isinstance(source, (str, bytes, os.PathLike)):
        src = _args.path(op, "source", source)
    else:
        raise _args.wrong_type(
            op,
            "source must be a path or a numpy array",
            "str, bytes, os.PathLike or ndarray",
            source,
        )
    if dataset_path is not None and not isinstance(dataset_path, str):
        raise _args.wrong_type(op, "dataset_path must be a str", "a str or None", dataset_path)
    return _progress.run(
        op,
        progress,
        lambda cb: _native.load(
            src,
            backend=_args.text(op, "backend", backend),
            scan_shape=_args.shape2(op, "scan_shape", scan_shape),
            scan_region=_args.region(op, "scan_region", scan_region),
            detector_region=_args.region(op, "detector_region", detector_region),
            det_bin=_args.integer(op, "det_bin", det_bin, minimum=1),
            dtype=_dtype_name(dtype),
            representation=_representation_name(representation),
            apply_mask=_args.flag(op, "apply_mask", apply_mask),
            memory_budget=_args.optional_integer(
                op, "memory_budget", memory_budget, minimum=0, maximum=_args.U64_MAX
            ),
            progress=cb,
            dataset_path=dataset_path,
            device=_args.optional_integer(op, "device", device, minimum=0),
            format=format,
            shape=None if shape is None else [int(v) for v in shape],
            raw_dtype=raw_dtype,
            file_header_bytes=_args.integer(op, "file_header_bytes", file_header_bytes, minimum=0),
            frame_header_bytes=_args.integer(
                op, "frame_header_bytes", frame_header_bytes, minimum=0
            ),
            frame_footer_bytes=_args.integer(
                op, "frame_footer_bytes", frame_footer_bytes, minimum=0
            ),
            float_scale=None if float_scale is None else float(float_scale),
        ),
    )


def inspect(
    source: str | os.PathLike[str], scan_shape: Sequence[int] | None = None
) -> dict[str, Any]:
    """Report on a source without decoding pixels.

    Parameters
    ----------
    source : str, bytes or os.PathLike
        An acquisition :func:`load` reads: a Dectris master (its shards are counted one by
        one), a plain HDF5 file, ``.npy``, Merlin ``.mib``, EMPAD, ... (a ``.qem`` file is
        refused: :func:`load` opens it).
    scan_shape : (int, int), optional
        The scan shape to check the frame count against.

    Returns
    -------
    dict
        Whether the source is ready to load (``ready``), and if not why (missing shards, unwritten
        chunks, frame-count mismatch), with its shapes, dtype and metadata.
    """
    return _native.inspect(
        _args.path("inspect", "source", source), _args.shape2("inspect", "scan_shape", scan_shape)
    )


def discover(folder: str | os.PathLike[str]) -> list[str]:
    """Every Dectris master file (``*_master.h5``) under ``folder``, recursively, sorted."""
    return list(_native.discover(_args.path("discover", "folder", folder)))


def save(dataset: Dataset, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write a dataset as a ``.qem`` file (its ENCODED form; reopen with :func:`load`).

    An ENCODED dataset is written as it is; a dense uint8/uint16 one is encoded first. The
    file is written to a temporary name and renamed into place, so ``path`` is either the old
    file or the complete new one. The GIL is released while writing.

    Parameters
    ----------
    dataset : Dataset
        A loaded dataset (uint8 or uint16 counts; uint32 is refused, as ENCODED holds counts up
        to 65535).
    path : str or os.PathLike
        The file to write (conventionally ``*.qem``; it is recognised by its content).

    Returns
    -------
    dict
        ``path``, ``file_bytes``, ``n_frames``, ``encoded_bytes``, ``dense_bytes``,
        ``encode_seconds``, ``seconds``.

    Raises
    ------
    InvalidArgumentError, QuantemIOError
    """
    return _native.save(_args.dataset("save", dataset, "dataset"), _args.path("save", "path", path))


# ``ds.calibration`` (quantem.gpu.calibration installs it on the Dataset class). Datasets
# pickle as handles that reopen their source (``quantem.gpu.lazy``), and ``io.load_lazy`` gives
# a dask.array decoded by the engine on compute; dask is imported only when a lazy array is
# made.
from quantem.gpu import calibration as _calibration  # noqa: E402, F401
from quantem.gpu.lazy import load_lazy  # noqa: E402

__all__ += ["load_lazy"]
