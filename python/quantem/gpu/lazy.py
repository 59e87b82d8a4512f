"""Datasets that travel, and lazy dask arrays decoded by the engine.

* **Pickling.** A :class:`~quantem.gpu.io.Dataset` pickles as a *handle*: the source file, the
  load options its provenance records (scan shape, scan/detector region, binning, dtype, mask
  policy, HDF5 dataset path) and the source's identity (size, mtime, chunk-index digest). The
  receiving process reopens the source with :func:`quantem.gpu.io.load` on its own backend
  (``"auto"``: its GPU if it has one, else the CPU) and checks that the identity is unchanged
  (else :class:`~quantem.gpu.SourceError`). The resident bytes never travel: that is what lets
  Dask, ``multiprocessing`` and joblib carry a 100 GB acquisition in a few hundred bytes. A
  dataset made from an in-memory numpy array has no source to reopen and refuses to pickle.
* **Lazy arrays.** :func:`load_lazy` / :func:`to_dask` give a ``dask.array`` ``(R_r, R_c, k_r,
  k_c)`` whose chunks are blocks of whole scan rows (a chunk is one ``io.load(...,
  scan_region=...)`` on whichever worker computes it), sized to hold whole source chunks where
  the source says how many frames a chunk holds.
"""

from __future__ import annotations

import copyreg
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from quantem.gpu import _native

__all__ = ["load_lazy", "reopen", "to_dask"]

#: Load options a handle carries (the keyword arguments of ``io.load``).
_HANDLE_KEYS = (
    "scan_shape",
    "scan_region",
    "detector_region",
    "det_bin",
    "dtype",
    "apply_mask",
    "dataset_path",
)


def _pair(v) -> tuple[int, int] | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return (int(v["rows"]), int(v["cols"]))
    return (int(v[0]), int(v[1]))


def _region(v) -> tuple[int, int, int, int] | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return tuple(int(v[k]) for k in ("row_start", "row_stop", "col_start", "col_stop"))
    return tuple(int(x) for x in v)


def handle(ds) -> dict[str, Any]:
    """What a pickled dataset carries: ``source``, ``load`` (``io.load`` keyword arguments),
    ``identity`` (files with size and mtime, the chunk-index digest) and ``calibration`` (the
    fields of ``ds.calibration`` the user set).

    Raises
    ------
    InvalidArgumentError
        For a dataset made from an in-memory array (no source to reopen).
    """
    from quantem.gpu._args import invalid

    p = ds.provenance
    if p.get("source_kind") == "array" or not p.get("files"):
        raise invalid(
            "pickle Dataset",
            "a dataset loaded from an in-memory array has no source to reopen (its bytes "
            "are never pickled)",
            "a dataset loaded from a file",
            f"source_kind {p.get('source_kind')!r}",
        )
    source_dtype, result_dtype = p.get("source_dtype"), p.get("result_dtype")
    mask = p.get("mask_policy") or {}
    load = {
        "scan_shape": _pair(p.get("source_scan_shape")),
        "scan_region": _region(p.get("scan_region")),
        "detector_region": _region(p.get("detector_region")),
        "det_bin": int(p.get("det_bin") or 1),
        "dtype": "native" if result_dtype == source_dtype else str(result_dtype),
        "apply_mask": bool(mask.get("applied", True)),
        # A Dectris master records its data path but is opened by its master file alone.
        "dataset_path": p.get("dataset_path") if p.get("source_kind") == "hdf5_dataset" else None,
    }
    if p.get("source_kind") == "qem":
        # A .qem file refuses regions, binning and dtype changes: it is reopened as it is.
        load = {
            "scan_shape": None,
            "scan_region": None,
            "detector_region": None,
            "det_bin": 1,
            "dtype": "native",
            "apply_mask": load["apply_mask"],
            "dataset_path": None,
        }
    files = [
        {"path": str(f["path"]), "size": int(f["size"]), "mtime_ns": int(f["mtime_ns"])}
        for f in p["files"]
    ]
    from quantem.gpu import calibration

    return {
        "source": files[0]["path"],
        "load": load,
        "identity": {"files": files, "chunk_index_digest": p.get("chunk_index_digest")},
        # The fields of ds.calibration the user set (the file's are read again on reopen).
        "calibration": calibration.user_values(ds),
    }


def reopen(h: dict[str, Any], backend: str = "auto", **load_options):
    """Reopen a :func:`handle` (what unpickling a dataset does): the same source and load
    options on this process's ``backend``; a source whose files or chunk index changed since
    the handle was made raises :class:`~quantem.gpu.SourceError`."""
    from quantem.gpu import io

    for f in h["identity"]["files"]:
        try:
            st = os.stat(f["path"])
        except OSError as e:
            raise _source_changed(
                f["path"], "the file exists", f"{type(e).__name__}: {e}"
            ) from None
        if st.st_size != f["size"] or st.st_mtime_ns != f["mtime_ns"]:
            raise _source_changed(
                f["path"],
                f"size {f['size']}, mtime_ns {f['mtime_ns']}",
                f"size {st.st_size}, mtime_ns {st.st_mtime_ns}",
            )
    kwargs = {k: v for k, v in h["load"].items() if k in _HANDLE_KEYS}
    kwargs.update(load_options)
    ds = io.load(h["source"], backend=backend, **kwargs)
    digest = h["identity"].get("chunk_index_digest")
    found = ds.provenance.get("chunk_index_digest")
    if digest is not None and found != digest:
        ds.close()
        raise _source_changed(h["source"], f"chunk index digest {digest}", f"{found}")
    if h.get("calibration"):
        ds.calibration = ds.calibration.replace(**h["calibration"])
    return ds


def _source_changed(path: str, expected: str, found: str):
    # The engine's own SourceError, raised through a load of a path that cannot exist would be
    # indirect; build the error the way the engine words it.
    err = _native.SourceError(
        f"reopen dataset handle: {path}: the source changed since the dataset was pickled "
        f"(expected {expected}; found {found})"
    )
    for k, v in (
        ("op", "reopen dataset handle"),
        ("file", path),
        ("expected", expected),
        ("found", found),
    ):
        try:
            setattr(err, k, v)
        except AttributeError:
            pass
    return err


def _reduce_dataset(ds):
    return (reopen, (handle(ds),))


copyreg.pickle(_native.Dataset, _reduce_dataset)


# ----------------------------------------------------------------------------- lazy arrays


def _load_block(
    source: str, load: dict[str, Any], rows: tuple[int, int], cols: tuple[int, int], backend: str
) -> np.ndarray:
    from quantem.gpu import io

    kwargs = dict(load)
    kwargs["scan_region"] = (rows[0], rows[1], cols[0], cols[1])
    with io.load(source, backend=backend, **kwargs) as ds:
        return ds.to_numpy(force=True)


def _chunk_frames(source: str) -> int | None:
    """Frames per source chunk, where the source says (Dectris/HDF5 chunking)."""
    try:
        import h5py  # noqa: F401  (optional: only to read the chunk shape)
    except ImportError:
        return None
    from quantem.gpu import io

    try:
        report = io.inspect(source)
    except Exception:
        return None
    for key in ("chunk_frames", "frames_per_chunk"):
        if isinstance(report.get(key), int) and report[key] > 0:
            return int(report[key])
    return None


def row_blocks(
    n_rows: int,
    n_cols: int,
    rows_per_block: int | None = None,
    chunk_frames: int | None = None,
    target_frames: int = 4096,
) -> list[tuple[int, int]]:
    """Blocks of whole scan rows ``[(row_start, row_stop), ...]`` covering ``n_rows``.

    ``rows_per_block`` wins when given; else a block holds about ``target_frames`` frames,
    rounded so that a block boundary falls on a source-chunk boundary where ``chunk_frames``
    is known (so no chunk is read by two blocks)."""
    if rows_per_block is None:
        rows_per_block = max(1, target_frames // max(1, n_cols))
        if chunk_frames:
            # Smallest row count whose frames are a whole number of chunks.
            step = chunk_frames // np.gcd(chunk_frames, n_cols)
            rows_per_block = max(step, rows_per_block // step * step)
    rows_per_block = max(1, min(int(rows_per_block), n_rows))
    return [(r, min(r + rows_per_block, n_rows)) for r in range(0, n_rows, rows_per_block)]


def load_lazy(
    source: str | os.PathLike[str],
    backend: str = "auto",
    rows_per_block: int | None = None,
    scan_shape: Sequence[int] | None = None,
    scan_region: Sequence[int] | None = None,
    detector_region: Sequence[int] | None = None,
    det_bin: int = 1,
    dtype="native",
    apply_mask: bool = True,
    dataset_path: str | None = None,
):
    """A lazy ``dask.array`` of an acquisition ``(R_r, R_c, k_r, k_c)``.

    Nothing is decoded here: the shape and dtype come from loading one frame. Each chunk is a
    block of whole scan rows, loaded by the engine (``io.load(..., scan_region=block)``, then
    a dense numpy copy) on whichever process computes it. Block boundaries fall on source-chunk
    boundaries where the source reports them (see :func:`row_blocks`).

    Parameters are those of :func:`quantem.gpu.io.load`; ``rows_per_block`` fixes the chunking.
    """
    import dask.array as da
    from dask import delayed

    from quantem.gpu import io

    src = os.fspath(source)
    load = {
        "scan_shape": scan_shape,
        "detector_region": detector_region,
        "det_bin": det_bin,
        "dtype": dtype,
        "apply_mask": apply_mask,
        "dataset_path": dataset_path,
    }
    if scan_region is None:
        info = io.inspect(src, scan_shape=scan_shape)
        rows, cols = _pair(info.get("scan_shape"))
        r0, c0 = 0, 0
    else:
        r0, r1, c0, c1 = (int(v) for v in scan_region)
        rows, cols = r1 - r0, c1 - c0
    with io.load(src, backend=backend, scan_region=(r0, r0 + 1, c0, c0 + 1), **load) as probe:
        _, _, k_r, k_c = probe.shape
        dt = probe.dtype
    blocks = row_blocks(rows, cols, rows_per_block, _chunk_frames(src))
    parts = [
        da.from_delayed(
            delayed(_load_block, pure=True)(src, load, (r0 + a, r0 + b), (c0, c0 + cols), backend),
            shape=(b - a, cols, k_r, k_c),
            dtype=dt,
        )
        for a, b in blocks
    ]
    return da.concatenate(parts, axis=0)


def to_dask(ds, rows_per_block: int | None = None):
    """``ds`` as a lazy ``dask.array`` ``(R_r, R_c, k_r, k_c)`` that reopens its source per
    block of scan rows (see :func:`load_lazy`): the same load options (regions, binning,
    dtype, mask), on ``ds``'s backend; the dataset's resident data is not used or copied.
    Also ``ds.to_dask(rows_per_block=None)``.

    Raises
    ------
    InvalidArgumentError
        For a dataset made from an in-memory array (no source to reopen): use
        ``dask.array.from_array(ds.to_numpy())``.
    """
    from quantem.gpu import _args

    _args.dataset("to_dask", ds)
    if rows_per_block is not None:
        rows_per_block = _args.integer("to_dask", "rows_per_block", rows_per_block, minimum=1)
    h = handle(ds)
    load = dict(h["load"])
    return load_lazy(h["source"], backend=ds.backend, rows_per_block=rows_per_block, **load)


# ``ds.to_dask()``: the method form of :func:`to_dask`.
_native.Dataset.to_dask = to_dask
