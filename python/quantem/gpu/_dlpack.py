"""DLPack (``__dlpack__``/``__dlpack_device__``) for results.

``np.from_dlpack(result)``, ``torch.from_dlpack(result)``, ``cupy.from_dlpack(...)`` and
``jax.dlpack`` take the protocol. What each object exports:

* a result holding host NumPy arrays exports its main image without a copy (the NumPy array
  itself implements the protocol; this module only picks the array):
  :class:`~quantem.gpu.detector.DetectorImage` its ``image``,
  :class:`~quantem.gpu.dpc.DPCResult` and :class:`~quantem.gpu.ssb.SSBResult` their ``phase``,
  :class:`~quantem.gpu.ssb.SSBFit` ``result.phase``. A :class:`~quantem.gpu.dpc.CoM` holds two
  equal arrays and exports neither (take ``com.com_row``/``com.com_col``, NumPy arrays, which
  speak DLPack themselves).
* a :class:`~quantem.gpu.io.Dataset` implements the protocol natively (``_native``, see
  docs/interop.md): a zero-copy view of a dense dataset on the CPU or the GPU, refused with a
  ``BufferError`` when the dataset is ENCODED.

Where something cannot be exported, :class:`DLPackUnavailableError` (an
:class:`~quantem.gpu.InvalidArgumentError` and a ``BufferError``, the exception the DLPack
protocol names) is raised.

Device-resident results (``device_result=True``) hold a
:class:`~quantem.gpu.results.DeviceArray` (native: it implements ``__dlpack__`` itself, as a
view of GPU memory, ``(2, device)``); :func:`exported` returns it like a NumPy array, so a
:class:`~quantem.gpu.detector.DetectorImage` with a device image exports the device memory,
and the protocol methods hand every keyword (``stream``, ``max_version``, ``dl_device``,
``copy``) to it unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantem.gpu import _args, _native

__all__ = ["DLPackUnavailableError", "exported"]


class DLPackUnavailableError(_native.InvalidArgumentError, BufferError):
    """The object cannot be exported through DLPack without a copy; the message says why and
    what to do instead."""


def _unavailable(op: str, message: str, expected: str, found: str) -> DLPackUnavailableError:
    return _args._make(DLPackUnavailableError, op, message, expected, found)


def exported(obj: Any) -> Any:
    """The object whose ``__dlpack__`` a result delegates to (a host NumPy array, or a
    :class:`~quantem.gpu.results.DeviceArray` of a device result), or
    :class:`DLPackUnavailableError`."""
    from quantem.gpu.detector import DetectorImage
    from quantem.gpu.dpc import CoM

    name = type(obj).__name__
    op = f"{name}.__dlpack__"
    if isinstance(obj, DetectorImage):
        a = obj.image
    elif isinstance(obj, CoM):
        raise _unavailable(
            op,
            "a CoM holds two arrays, so it exports neither",
            "np.from_dlpack(com.com_row) or np.from_dlpack(com.com_col)",
            "CoM",
        )
    elif hasattr(obj, "result") and hasattr(obj.result, "phase"):  # SSBFit
        a = obj.result.phase
    else:  # DPCResult, SSBResult
        a = getattr(obj, "phase", None)
    if not isinstance(a, np.ndarray) and not hasattr(a, "__dlpack__"):
        raise _unavailable(op, "the result holds no array to export", "an image", repr(a))
    return a


def _kwargs(stream, max_version, dl_device, copy) -> dict[str, Any]:
    """Only the keywords the caller gave (older exporters do not take all of them)."""
    out = {}
    for k, v in (
        ("stream", stream),
        ("max_version", max_version),
        ("dl_device", dl_device),
        ("copy", copy),
    ):
        if v is not None:
            out[k] = v
    return out


def result_dlpack(self, *, stream=None, max_version=None, dl_device=None, copy=None):
    """DLPack capsule of the result's main image (see :mod:`quantem.gpu._dlpack`): the
    array's own, so without a copy unless ``copy=True``."""
    return exported(self).__dlpack__(**_kwargs(stream, max_version, dl_device, copy))


def result_dlpack_device(self) -> tuple[int, int]:
    """``(device type, device id)`` of the exported array (``(1, 0)``: host memory;
    ``(2, k)``: a device result on CUDA device ``k``)."""
    return exported(self).__dlpack_device__()


def _install() -> None:
    from quantem.gpu.detector import DetectorImage
    from quantem.gpu.dpc import CoM, DPCResult
    from quantem.gpu.ssb import SSBFit, SSBResult

    for cls in (DetectorImage, CoM, DPCResult, SSBResult, SSBFit):
        cls.__dlpack__ = result_dlpack
        cls.__dlpack_device__ = result_dlpack_device
