"""quantem.gpu: a 4D-STEM engine (Rust core) for acquisitions ``I[R_r, R_c, k_r, k_c]``.

>>> from quantem.gpu import io, detector, dpc, ssb, device, browse
>>> device.available()
['cpu']
>>> with io.load("scan_master.h5", scan_shape=(256, 256)) as ds:
...     frame = ds[10, 20]
...     adf = detector.adf(ds)          # uint64 image, BF disk fitted from the mean DP
...     phase = dpc.run(ds).phase       # iDPC
>>> srv = browse.serve("scan_master.h5")   # the browse page at srv.url; srv.stop()

Every error raised by the engine is a :class:`QuantemError`; its subclasses name the category
(:class:`SourceError`, :class:`DecodeError`, ...) and carry ``op``, ``file``, ``frame``,
``expected`` and ``found`` attributes.
"""

# The extension first: with QEM_WARM_START=1 it starts the CUDA engine on a thread as it loads,
# so the context is made while numpy is imported (docs/performance.md, "First use").
from quantem.gpu import _native  # noqa: I001

if _native._warm_start:
    import atexit as _atexit

    # No exit while that thread is inside the driver.
    _atexit.register(_native._finish_warm_start)
from quantem.gpu import (
    _display,
    _dlpack,
    browse,
    calibration,
    detector,
    device,
    dpc,
    io,
    results,
    ssb,
)
from quantem.gpu._dlpack import DLPackUnavailableError
from quantem.gpu._native import (
    ArgumentTypeError,
    BackendUnavailableError,
    DecodeError,
    DeviceLostError,
    DtypeOverflowError,
    InvalidArgumentError,
    MemoryBudgetError,
    QuantemError,
    QuantemIOError,
    SourceError,
    __version__,
)
from quantem.gpu.io import DataRepresentation, Dataset, Dataset4dstemGPU

# Notebook display of the classes whose modules do not import ``_display`` themselves.
_display.attach(ssb.SSBResult, ssb.SSBFit)
_display.attach(detector.Products)
_display.attach(detector.DiskFit, ssb.SSB, html=_display.info_html, plot=None)

# DLPack of results (their host arrays, no copy) and datasets (refused, saying why).
_dlpack._install()

__all__ = [
    "ArgumentTypeError",
    "BackendUnavailableError",
    "DLPackUnavailableError",
    "DataRepresentation",
    "Dataset",
    "Dataset4dstemGPU",
    "DecodeError",
    "DeviceLostError",
    "DtypeOverflowError",
    "InvalidArgumentError",
    "MemoryBudgetError",
    "QuantemError",
    "QuantemIOError",
    "SourceError",
    "__version__",
    "browse",
    "calibration",
    "detector",
    "device",
    "dpc",
    "io",
    "results",
    "ssb",
]
