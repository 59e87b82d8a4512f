# Type stubs of the native module (crates/qem-py): what editors complete and type checkers
# check. tests/python/test_outputs.py checks that every public name of the built module is
# here and that each function's parameters match the module's own signatures.
from collections.abc import Callable, Mapping, Sequence
from os import PathLike
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from quantem.gpu.calibration import Calibration

__version__: str
_warm_start: bool

_Path = str | bytes | PathLike[str]
_Progress = Callable[[str, int, int], Any]

class QuantemError(Exception):
    kind: str
    op: str | None
    file: str | None
    frame: int | None
    expected: str | None
    found: str | None
    detail: str

class SourceError(QuantemError): ...
class DecodeError(QuantemError): ...
class BackendUnavailableError(QuantemError): ...
class MemoryBudgetError(QuantemError): ...
class DeviceLostError(QuantemError): ...
class InvalidArgumentError(QuantemError, ValueError): ...
class ArgumentTypeError(InvalidArgumentError, TypeError): ...
class DtypeOverflowError(QuantemError, ValueError): ...
class QuantemIOError(QuantemError, OSError): ...

class Dataset:
    """A loaded 4D-STEM acquisition ``I[R_r, R_c, k_r, k_c]`` (see ``quantem.gpu.io.load``)."""

    def show(self, **kwargs: Any) -> Any: ...
    @property
    def shape(self) -> tuple[int, int, int, int]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    @property
    def provenance(self) -> dict[str, Any]: ...
    @property
    def nbytes_resident(self) -> int: ...
    @property
    def representation(self) -> Any: ...
    @property
    def closed(self) -> bool: ...
    @property
    def _released(self) -> bool: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def __getitem__(self, index: Any) -> NDArray[Any]: ...
    def to_numpy(self, force: bool = False) -> NDArray[Any]: ...
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> NDArray[Any]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Dataset: ...
    def __exit__(self, *_args: object) -> bool: ...
    # Installed on the class by the Python package (quantem.gpu.calibration, .lazy).
    @property
    def calibration(self) -> Calibration: ...
    @calibration.setter
    def calibration(self, value: Calibration) -> None: ...
    @calibration.deleter
    def calibration(self) -> None: ...
    def to_dask(self, rows_per_block: int | None = None) -> Any: ...

class SsbPrepared:
    """An acquisition prepared for SSB (``quantem.gpu.ssb.SSB`` wraps it)."""

    def info(self) -> dict[str, Any]: ...
    def objectives(self) -> list[str]: ...
    def reconstruct(self, aberrations: Mapping[str, float]) -> dict[str, Any]: ...
    def objective(self, aberrations: Mapping[str, float], objective: str) -> float: ...
    def fit(
        self,
        *,
        seed: int,
        fit: Sequence[str],
        ranges: Mapping[str, tuple[float, float]] | None = None,
        objective: str = "coherence",
        global_evals: int | None = None,
        local_max_iter: int | None = None,
        local_starts: int | None = None,
        start: Mapping[str, float] = ...,
        progress: _Progress | None = None,
        coarse: bool = True,
    ) -> dict[str, Any]: ...

class BrowseServer:
    @property
    def url(self) -> str: ...
    @property
    def token(self) -> str | None: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def stopped(self) -> bool: ...
    def stop(self) -> None: ...

def load(
    source: _Path | NDArray[Any],
    *,
    backend: str = "auto",
    scan_shape: Sequence[int] | None = None,
    scan_region: Sequence[int] | None = None,
    detector_region: Sequence[int] | None = None,
    det_bin: int = 1,
    dtype: str = "native",
    representation: str | None = None,
    apply_mask: bool = True,
    memory_budget: int | None = None,
    progress: _Progress | None = None,
    dataset_path: str | None = None,
    format: str | None = None,
    shape: Sequence[int] | None = None,
    raw_dtype: str | None = None,
    file_header_bytes: int = 0,
    frame_header_bytes: int = 0,
    frame_footer_bytes: int = 0,
    float_scale: float | None = None,
    device: int | None = None,
) -> Dataset: ...
def save(dataset: Dataset, path: _Path) -> dict[str, Any]: ...
def inspect(source: _Path, scan_shape: Sequence[int] | None = None) -> dict[str, Any]: ...
def discover(folder: _Path) -> list[str]: ...
def backends() -> list[str]: ...
def resolve_backend(name: str = "auto") -> str: ...
def _inject_cuda_fault() -> None: ...
def _finish_warm_start() -> None: ...

class DeviceArray:
    """One result array in GPU memory (``device_result=True``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def device(self) -> int: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def to_numpy(self) -> NDArray[Any]: ...
    def _scaled(self, factor: float) -> DeviceArray: ...
    def __len__(self) -> int: ...
    def _repr_html_(self) -> str: ...

def detector_sum_dp(
    dataset: Dataset, progress: _Progress | None = None, device_result: bool = False
) -> NDArray[np.uint64] | DeviceArray: ...
def detector_mean_dp(
    dataset: Dataset, progress: _Progress | None = None, device_result: bool = False
) -> NDArray[np.float32] | DeviceArray: ...
def detector_max_dp(
    dataset: Dataset, progress: _Progress | None = None, device_result: bool = False
) -> NDArray[np.uint32] | DeviceArray: ...
def detector_fit_disk(dataset: Dataset) -> dict[str, Any]: ...
def detector_frames(dataset: Dataset, positions: Sequence[tuple[int, int]]) -> NDArray[Any]: ...
def detector_roi_dp(
    dataset: Dataset,
    *,
    rect: Sequence[int] | None = None,
    circle: Sequence[float] | None = None,
    positions: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]: ...
def detector_virtual_image(
    dataset: Dataset,
    mask: NDArray[Any],
    progress: _Progress | None = None,
    device_result: bool = False,
) -> NDArray[Any] | DeviceArray: ...
def detector_image(
    dataset: Dataset,
    kind: str,
    geometry: Mapping[str, Any],
    progress: _Progress | None = None,
    device_result: bool = False,
) -> dict[str, Any]: ...
def detector_moments(
    dataset: Dataset, progress: _Progress | None = None, device_result: bool = False
) -> dict[str, NDArray[np.uint64] | DeviceArray]: ...
def detector_products(
    dataset: Dataset,
    names: Sequence[str],
    geometry: Mapping[str, Any],
    progress: _Progress | None = None,
    device_result: bool = False,
) -> dict[str, Any]: ...
def dpc_center_of_mass(
    dataset: Dataset,
    centered: bool = True,
    progress: _Progress | None = None,
    device_result: bool = False,
) -> dict[str, Any]: ...
def dpc_run(
    dataset: Dataset,
    *,
    rotation_deg: float | None = None,
    transpose: bool | None = None,
    edge: Literal["periodic", "mirror"] | str = "periodic",
    progress: _Progress | None = None,
) -> dict[str, Any]: ...
def dpc_integrate(
    g_row: NDArray[np.float64], g_col: NDArray[np.float64], edge: str = "periodic"
) -> NDArray[np.float64]: ...
def ssb_prepare(
    dataset: Dataset,
    *,
    voltage_kv: float,
    semiangle_mrad: float,
    scan_step_a: tuple[float, float],
    det_sampling_mrad: float | None = None,
    rotation_deg: float = 0.0,
    transpose: bool = False,
    compat_2alpha: bool = False,
    bf_threshold: float = 0.0,
    memory_budget: int | None = None,
    g_storage: str | None = None,
    engine: str = "auto",
    progress: _Progress | None = None,
) -> SsbPrepared: ...
def _browse_serve(
    source: Any,
    backend: str,
    host: str,
    port: int,
    token: Any,
    memory_budget: int | None,
    representation: str | None,
) -> BrowseServer: ...
def distributed_fit_disk(sum_dp: NDArray[Any], n_frames: int) -> dict[str, Any]: ...
def distributed_dpc(
    dataset: Dataset,
    sum: NDArray[Any],
    m_row: NDArray[Any],
    m_col: NDArray[Any],
    adf: NDArray[Any] | None = None,
    adf_info: str | None = None,
    *,
    rotation_deg: float | None = None,
    transpose: bool | None = None,
    edge: str = "periodic",
) -> dict[str, Any]: ...
