"""Past one process: scan blocks and acquisition batches on a ``dask.distributed`` cluster.

Two ways to use many workers (processes, GPUs, machines), both on Dask's scheduler:

* **Scan blocks** (:func:`products`, :func:`dpc`, :func:`bf_pixels`): one acquisition cut into
  blocks of whole scan rows. Each task loads its block on its worker with the engine
  (``io.load(source, scan_region=block)``, the worker's backend and GPU) and returns partial
  results; the merge on the client is exact: ``uint64`` sums added, per-position images
  placed by block, the mean DP divided from the exact sum, the BF disk fitted from it by the
  engine's own fit, DPC/iDPC run by the engine on the merged moments and ADF image. Integer
  results equal the single-process ones bit for bit; floats (CoM, DPC) agree to rounding.
* **Acquisition batches** (:func:`batch`): one task per acquisition (load, products, optional
  DPC and SSB fit), results in a pandas table, products saved per acquisition; a failing
  acquisition is a row with its error, the batch goes on.

What workers read: each block task opens the source itself (the master file and the data
files) and reads only the chunks of its scan rows; the engine plans a load from the HDF5 chunk
index of its own open, so the index is read once per task, not shipped (the engine exposes no
index object to Python). Block boundaries fall on source-chunk boundaries where the source
reports them, so no chunk is decoded twice.

Several GPUs of one host: :func:`local_gpu_cluster` starts one worker per GPU, each with its
own ``CUDA_VISIBLE_DEVICES``. See ``docs/distributed.md``.

>>> from dask.distributed import Client, LocalCluster
>>> from quantem.gpu import distributed
>>> client = Client(LocalCluster(n_workers=2, threads_per_worker=1))
>>> out = distributed.products("scan_master.h5", client, ["bf", "adf", "sum_dp", "com"])
>>> res = distributed.dpc("scan_master.h5", client)
>>> table = distributed.batch(folder, client, products=["adf"], out_dir="results")
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantem.gpu import _args, _native
from quantem.gpu.lazy import row_blocks

__all__ = [
    "batch",
    "bf_pixels",
    "blocks",
    "dpc",
    "local_gpu_cluster",
    "products",
]

_DETECTORS = ("bf", "abf", "adf", "haadf", "df", "annular")
_PASS1 = ("sum_dp", "mean_dp", "max_dp", "moments", "com")
_GEOMETRY = ("inner", "outer", "center", "radius", "unit", "semiangle_mrad", "det_sampling_mrad")
_LOAD_KEYS = (
    "scan_shape",
    "detector_region",
    "det_bin",
    "dtype",
    "representation",
    "apply_mask",
    "memory_budget",
    "dataset_path",
)


# ------------------------------------------------------------------------------ planning


def _load_options(op: str, load: Mapping[str, Any] | None) -> dict[str, Any]:
    load = dict(load or {})
    bad = [k for k in load if k not in _LOAD_KEYS + ("scan_region", "backend")]
    if bad:
        raise _args.invalid(
            op, "unknown load option", "keys of io.load: " + ", ".join(_LOAD_KEYS), ", ".join(bad)
        )
    return load


def blocks(
    source: str | os.PathLike[str],
    rows_per_block: int | None = None,
    n_blocks: int | None = None,
    scan_shape: Sequence[int] | None = None,
    scan_region: Sequence[int] | None = None,
) -> list[tuple[int, int, int, int]]:
    """The scan regions (half-open, whole rows of the loaded region) a source is cut into.

    ``n_blocks`` asks for about that many blocks; ``rows_per_block`` for a block height; with
    neither, blocks of about 4096 frames aligned to source chunks."""
    from quantem.gpu import io
    from quantem.gpu.lazy import _chunk_frames, _pair

    src = os.fspath(source)
    if scan_region is None:
        info = io.inspect(src, scan_shape=scan_shape)
        shape = _pair(info.get("scan_shape"))
        if shape is None:
            raise _args.invalid(
                "distributed.blocks",
                "the source does not say its scan shape",
                "scan_shape=(rows, cols)",
                "None",
            )
        r0, r1, c0, c1 = 0, shape[0], 0, shape[1]
    else:
        r0, r1, c0, c1 = (int(v) for v in scan_region)
    rows = r1 - r0
    if n_blocks is not None:
        n = _args.integer("distributed.blocks", "n_blocks", n_blocks, minimum=1)
        rows_per_block = -(-rows // min(n, rows))
    return [
        (r0 + a, r0 + b, c0, c1)
        for a, b in row_blocks(rows, c1 - c0, rows_per_block, _chunk_frames(src))
    ]


# ------------------------------------------------------------------------------ worker tasks


def _open(source: str, load: dict[str, Any], region):
    from quantem.gpu import io

    kw = {k: v for k, v in load.items() if k != "scan_region"}
    kw.setdefault("backend", "auto")
    return io.load(source, scan_region=region, **kw)


def _block_task(source, load, region, which, geometry) -> dict[str, Any]:
    """Partial results of one block (numpy arrays; exact integers)."""
    from quantem.gpu import detector

    t0 = time.perf_counter()
    with _open(source, load, region) as ds:
        t_load = time.perf_counter() - t0
        res = detector.products(ds, list(which), **geometry)
        out: dict[str, Any] = {
            "region": region,
            "backend": ds.backend,
            "device": ds.device,
            "pid": os.getpid(),
            "load_s": t_load,
            "nbytes_resident": ds.nbytes_resident,
        }
        for name, v in res.items():
            if name in _DETECTORS:
                out[name] = {
                    "image": v.image,
                    "inner_px": v.inner_px,
                    "outer_px": v.outer_px,
                    "mask_pixels": v.mask_pixels,
                    "center": v.center,
                    "radius": v.radius,
                }
            elif name == "moments":
                out[name] = {k: np.asarray(a) for k, a in v.items()}
            elif name in ("sum_dp", "max_dp"):
                out[name] = np.asarray(v)
    out["seconds"] = time.perf_counter() - t0
    return out


def _bf_task(source, load, region, pixels) -> dict[str, Any]:
    """The values of the BF ``pixels`` (flat detector indices) per frame of one block."""
    t0 = time.perf_counter()
    with _open(source, load, region) as ds:
        r, c, k_r, k_c = ds.shape
        dense = ds.to_numpy(force=True).reshape(r, c, k_r * k_c)
        out = np.ascontiguousarray(dense[:, :, pixels])
    return {"region": region, "images": out, "seconds": time.perf_counter() - t0}


def _dpc_task(source, load, region, merged, adf_info, params) -> dict[str, Any]:
    """DPC by the engine on merged moments/ADF; one frame of ``region`` gives calibration."""
    r0, _, c0, _ = region
    with _open(source, load, (r0, r0 + 1, c0, c0 + 1)) as ds:
        return _native.distributed_dpc(
            ds,
            merged["sum"],
            merged["m_row"],
            merged["m_col"],
            merged.get("adf"),
            None if adf_info is None else json.dumps(adf_info),
            **params,
        )


# ------------------------------------------------------------------------------ merging


def _gather(client, futures):
    return client.gather(futures)


def _place(parts: list[dict[str, Any]], key: Callable[[dict], np.ndarray], origin, shape):
    """Per-position images of every block placed into one ``shape`` array."""
    first = key(parts[0])
    out = np.zeros(shape, dtype=first.dtype)
    r0, c0 = origin
    for p in parts:
        a, b, _, _ = p["region"]
        out[a - r0 : b - r0, :] = key(p)
    return out


def _plan(op, source, client, load, rows_per_block, n_blocks):
    if client is None:
        raise _args.invalid(
            op, "a dask.distributed Client is required", "client=Client(...)", "None"
        )
    load = _load_options(op, load)
    src = os.fspath(source)
    regions = blocks(src, rows_per_block, n_blocks, load.get("scan_shape"), load.get("scan_region"))
    r0, c0 = regions[0][0], regions[0][2]
    shape = (regions[-1][1] - r0, regions[0][3] - c0)
    return src, load, regions, (r0, c0), shape


def _run_pass(client, src, load, regions, which, geometry, retries):
    futs = [
        client.submit(
            _block_task, src, load, reg, tuple(which), geometry, pure=False, retries=retries
        )
        for reg in regions
    ]
    return _gather(client, futs)


def _disk(sum_dp: np.ndarray, n_frames: int) -> dict[str, Any]:
    return dict(_native.distributed_fit_disk(np.ascontiguousarray(sum_dp, np.uint64), n_frames))


def products(
    source: str | os.PathLike[str],
    client,
    which: Sequence[str] | str,
    *,
    load: Mapping[str, Any] | None = None,
    rows_per_block: int | None = None,
    n_blocks: int | None = None,
    retries: int = 2,
    **geometry,
) -> dict[str, Any]:
    """Detector products of ``source`` computed over scan blocks on ``client``'s workers.

    Parameters
    ----------
    source : path
        A file every worker can open (Dectris master, plain HDF5, ``.qem``).
    client : dask.distributed.Client
    which : list of str or comma-separated str
        Any of ``detector.PRODUCT_NAMES`` (``bf``, ``adf``, ..., ``sum_dp``, ``mean_dp``,
        ``max_dp``, ``moments``, ``com``).
    load : dict, optional
        ``io.load`` options (``scan_shape``, ``scan_region``, ``detector_region``, ``det_bin``,
        ``dtype``, ``apply_mask``, ``backend``, ...); a ``scan_region`` is cut into blocks.
    rows_per_block, n_blocks : int, optional
        Block size (see :func:`blocks`).
    retries : int
        Times Dask retries a block whose worker died.
    **geometry
        ``inner``, ``outer``, ``center``, ``radius``, ``unit``, ``semiangle_mrad``,
        ``det_sampling_mrad`` as for ``detector.products``. Without ``center``/``radius`` the
        BF disk is fitted from the merged mean DP (a first pass computes the exact sum DP).

    Returns
    -------
    dict
        ``name → result``: ``uint64`` images ``(R_r, R_c)`` for detectors, ``sum_dp`` (uint64),
        ``mean_dp`` (float32, from the exact sum), ``max_dp`` (uint32), ``moments`` (dict of
        uint64 images), ``com`` (:class:`quantem.gpu.dpc.CoM`, from the merged moments by the
        engine); plus ``"disk"`` (the disk used) and ``"blocks"`` (per-block records: region,
        worker pid, backend, seconds).
    """
    from quantem.gpu.detector import PRODUCT_NAMES

    op = "distributed.products"
    names = [w.strip().lower() for w in (which.split(",") if isinstance(which, str) else which)]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in PRODUCT_NAMES]
    if unknown or not names:
        raise _args.invalid(
            op, "unknown or no product", ", ".join(PRODUCT_NAMES), ", ".join(unknown) or "nothing"
        )
    bad = [k for k in geometry if k not in _GEOMETRY]
    if bad:
        raise _args.invalid(op, "unknown geometry option", ", ".join(_GEOMETRY), ", ".join(bad))
    src, load, regions, origin, shape = _plan(op, source, client, load, rows_per_block, n_blocks)
    n_frames = shape[0] * shape[1]
    dets = [n for n in names if n in _DETECTORS]
    need_disk = bool(dets) and (geometry.get("center") is None or geometry.get("radius") is None)
    first = [n for n in names if n in _PASS1]
    if "com" in first:
        first = [n for n in first if n != "com"] + ["moments"]
    if "mean_dp" in first or need_disk:
        first = [n for n in first if n != "mean_dp"] + ["sum_dp"]
    first = list(dict.fromkeys(first))
    records: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    disk = None
    if first:
        parts = _run_pass(client, src, load, regions, first, {}, retries)
        records += [_record(p, "pass 1") for p in parts]
        if "sum_dp" in first:
            total = np.zeros_like(parts[0]["sum_dp"], dtype=np.uint64)
            for p in parts:
                total += p["sum_dp"]
            out["sum_dp"] = total
            out["mean_dp"] = (total.astype(np.float64) / float(n_frames)).astype(np.float32)
            if need_disk:
                disk = _disk(total, n_frames)
        if "max_dp" in first:
            out["max_dp"] = np.maximum.reduce([p["max_dp"] for p in parts])
        if "moments" in first:
            out["moments"] = {
                k: _place(parts, lambda p, k=k: p["moments"][k], origin, shape)
                for k in ("sum", "m_row", "m_col")
            }
    if dets:
        geo = dict(geometry)
        if disk is not None:
            geo.setdefault("center", tuple(disk["center_px"]))
            geo.setdefault("radius", float(disk["radius_px"]))
        parts = _run_pass(client, src, load, regions, dets, geo, retries)
        records += [_record(p, "pass 2") for p in parts]
        for d in dets:
            info = {k: v for k, v in parts[0][d].items() if k != "image"}
            info["image"] = _place(parts, lambda p, d=d: p[d]["image"], origin, shape)
            out[d] = info
        if disk is None:
            disk = {
                "center_px": tuple(geo["center"]),
                "radius_px": float(geo["radius"]),
                "fitted": False,
            }
    if "com" in names:
        out["com"] = _com(client, src, load, regions, out["moments"], retries)
    result = {n: out[n] for n in names}
    result["disk"] = disk
    result["blocks"] = records
    return result


def _record(p: dict[str, Any], stage: str) -> dict[str, Any]:
    return {k: p.get(k) for k in ("region", "pid", "backend", "device", "seconds", "load_s")} | {
        "stage": stage
    }


def _com(client, src, load, regions, moments, retries):
    """The centred CoM from merged moments, by the engine (DPC's own CoM step)."""
    from quantem.gpu.dpc import CoM

    fut = client.submit(
        _dpc_task,
        src,
        load,
        regions[0],
        dict(moments),
        None,
        {"rotation_deg": 0.0},
        pure=False,
        retries=retries,
    )
    d = fut.result()
    return CoM(
        com_row=d["com_row"],
        com_col=d["com_col"],
        zero_frames=int(d["zero_frames"]),
        centered=True,
        unit=str(d["unit"]),
        provenance={"operation": "distributed.products com", "dpc": d["provenance"]},
    )


def dpc(
    source: str | os.PathLike[str],
    client,
    *,
    rotation_deg: float | None = None,
    transpose: bool | None = None,
    edge: str = "periodic",
    load: Mapping[str, Any] | None = None,
    rows_per_block: int | None = None,
    n_blocks: int | None = None,
    retries: int = 2,
):
    """``dpc.run`` over scan blocks: the exact moments and the default ADF image (``[r, 2r]``
    around the disk fitted from the merged mean DP) are merged from blocks, then the engine runs
    the CoM, rotation search, integration and sign choice on them (one task). Returns a
    :class:`quantem.gpu.dpc.DPCResult` equal to ``dpc.run`` on the whole scan (floats to
    rounding; its provenance adds ``"blocks"``)."""
    from quantem.gpu.dpc import DPCResult

    op = "distributed.dpc"
    p = {
        "rotation_deg": _args.optional_number(op, "rotation_deg", rotation_deg),
        "transpose": _args.optional_flag(op, "transpose", transpose),
        "edge": _args.text(op, "edge", edge, ("periodic", "mirror")),
    }
    res = products(
        source,
        client,
        ["moments", "adf"],
        load=load,
        rows_per_block=rows_per_block,
        n_blocks=n_blocks,
        retries=retries,
    )
    src, load_opts, regions, _, _ = _plan(op, source, client, load, rows_per_block, n_blocks)
    adf = res["adf"]
    adf_info = {
        "inner_px": adf["inner_px"],
        "outer_px": adf["outer_px"],
        "mask_pixels": adf["mask_pixels"],
        "disk_center_px": list(res["disk"]["center_px"]),
        "disk_radius_px": res["disk"]["radius_px"],
    }
    merged = dict(res["moments"])
    merged["adf"] = adf["image"]
    d = client.submit(
        _dpc_task, src, load_opts, regions[0], merged, adf_info, p, pure=False, retries=retries
    ).result()
    d["provenance"] = dict(d["provenance"]) | {
        "blocks": res["blocks"],
        "operation": "distributed.dpc",
    }
    return DPCResult._from_native(d)


def bf_pixels(
    source: str | os.PathLike[str],
    client,
    *,
    bf_threshold: float = 0.0,
    load: Mapping[str, Any] | None = None,
    rows_per_block: int | None = None,
    n_blocks: int | None = None,
    retries: int = 2,
) -> dict[str, Any]:
    """SSB's BF-pixel preparation over scan blocks: the BF pixels of the merged mean DP and
    their images, merged exactly.

    The pixels are those ``ssb.SSB`` selects: inside the disk fitted from the mean DP, with a
    mean above ``bf_threshold`` × the maximum and above 0. Returns ``pixels`` (flat detector
    indices), ``images`` (``(R_r, R_c, B)`` in the dataset dtype), ``disk``, ``mean_dp``.
    """
    src, load_opts, regions, origin, shape = _plan(
        "distributed.bf_pixels", source, client, load, rows_per_block, n_blocks
    )
    res = products(
        source,
        client,
        ["sum_dp"],
        load=load,
        rows_per_block=rows_per_block,
        n_blocks=n_blocks,
        retries=retries,
    )
    n = shape[0] * shape[1]
    mean = (res["sum_dp"].astype(np.float64) / float(n)).astype(np.float32)
    disk = _disk(res["sum_dp"], n)
    k_r, k_c = mean.shape
    rr, cc = np.meshgrid(
        np.arange(k_r, dtype=np.float64), np.arange(k_c, dtype=np.float64), indexing="ij"
    )
    (cr, ccol), rad = disk["center_px"], disk["radius_px"]
    v = mean.astype(np.float64)
    inside = (rr - cr) ** 2 + (cc - ccol) ** 2 <= rad * rad
    sel = (v > float(bf_threshold) * float(v.max(initial=0.0))) & (v > 0.0) & inside
    pixels = np.flatnonzero(sel.reshape(-1))
    futs = [
        client.submit(_bf_task, src, load_opts, reg, pixels, pure=False, retries=retries)
        for reg in regions
    ]
    parts = _gather(client, futs)
    images = np.zeros(shape + (pixels.size,), dtype=parts[0]["images"].dtype)
    for p in parts:
        a, b, _, _ = p["region"]
        images[a - origin[0] : b - origin[0]] = p["images"]
    return {
        "pixels": pixels,
        "images": images,
        "disk": disk,
        "mean_dp": mean,
        "blocks": res["blocks"],
    }


# ------------------------------------------------------------------------------ batches


def _acquisition_task(source, load, which, do_dpc, ssb_opts, out_dir, out_name) -> dict[str, Any]:
    """One acquisition: load, products, optional DPC and SSB fit, saved; never raises."""
    from quantem.gpu import detector, io
    from quantem.gpu import dpc as dpc_mod
    from quantem.gpu import ssb as ssb_mod

    row: dict[str, Any] = {
        "source": source,
        "ok": False,
        "error": None,
        "error_type": None,
        "pid": os.getpid(),
    }
    t0 = time.perf_counter()
    try:
        kw = dict(load)
        kw.setdefault("backend", "auto")
        with io.load(source, **kw) as ds:
            row.update(shape=tuple(ds.shape), dtype=str(ds.dtype), backend=ds.backend)
            saved: dict[str, np.ndarray] = {}
            if which:
                res = detector.products(ds, list(which))
                for name, v in res.items():
                    if name in _DETECTORS:
                        saved[name] = np.asarray(v.image)
                        row[f"{name}_mean"] = float(np.mean(v.image))
                    elif name == "moments":
                        saved.update({f"moments_{k}": np.asarray(a) for k, a in v.items()})
                    elif name == "com":
                        saved["com_row"], saved["com_col"] = v.com_row, v.com_col
                    else:
                        saved[name] = np.asarray(v)
            if do_dpc:
                r = dpc_mod.run(ds)
                saved["dpc_phase"] = r.phase
                row.update(
                    dpc_rotation_deg=r.rotation_deg,
                    dpc_transpose=r.transpose,
                    dpc_confident=r.confident,
                )
            if ssb_opts is not None:
                opts = dict(ssb_opts)
                fit = opts.pop("fit", None)
                s = ssb_mod.SSB(ds, **opts)
                if fit is not None:
                    f = s.fit(**dict(fit))
                    row.update({f"ssb_{k}": v for k, v in f.aberrations.items()})
                    row["ssb_loss"] = f.loss
                    saved["ssb_phase"] = np.asarray(s.reconstruct(f.aberrations).phase)
                else:
                    saved["ssb_phase"] = np.asarray(s.reconstruct().phase)
        if out_dir is not None:
            d = Path(out_dir) / out_name
            d.mkdir(parents=True, exist_ok=True)
            for name, a in saved.items():
                np.save(d / f"{name}.npy", a)
            row["out_dir"] = str(d)
        row["products"] = sorted(saved)
        row["ok"] = True
    except Exception as e:  # reported per acquisition; the batch goes on
        row["error"] = str(e)
        row["error_type"] = type(e).__name__
        row["traceback"] = traceback.format_exc(limit=3)
    row["seconds"] = time.perf_counter() - t0
    return row


def _stem(path: str) -> str:
    """The acquisition's name for its output folder (``scan_master.h5`` → ``scan``)."""
    name = Path(path).name
    for suffix in (".h5", ".hdf5", ".qem"):
        name = name.removesuffix(suffix)
    return name.removesuffix("_master")


def batch(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    client,
    *,
    products: Sequence[str] = ("sum_dp", "bf", "adf"),
    dpc: bool = False,
    ssb: Mapping[str, Any] | Callable[[str], Mapping[str, Any]] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    load: Mapping[str, Any] | None = None,
    retries: int = 1,
):
    """One task per acquisition; a pandas ``DataFrame`` with one row per acquisition.

    Parameters
    ----------
    sources : folder or list of paths
        A folder is searched with ``io.discover`` (Dectris master files, recursively).
    products : list of str
        ``detector.products`` names computed per acquisition (one pass).
    dpc : bool
        Also run ``dpc.run`` (rotation, transpose, confidence in the table; phase saved).
    ssb : dict, callable or None
        ``ssb.SSB`` keyword arguments shared by every acquisition (``voltage_kv``,
        ``semiangle_mrad``, ``scan_step_a``, ...; ``"fit": {...}`` runs ``SSB.fit`` with those
        arguments), or ``callable(source) -> dict`` for per-acquisition optics.
    out_dir : path, optional
        Products are saved as ``out_dir/<acquisition>/<name>.npy`` (``<acquisition>`` is the file
        name without ``_master.h5``, prefixed by its index when two sources share it).
    load : dict, optional
        ``io.load`` options for every acquisition.

    Returns
    -------
    pandas.DataFrame
        Columns ``source, ok, error, error_type, seconds, shape, dtype, backend, products,
        out_dir``, per-detector means, DPC/SSB results where asked. A failed acquisition has
        ``ok=False`` and its error; the others are unaffected.
    """
    import pandas as pd

    from quantem.gpu import io

    if isinstance(sources, (str, os.PathLike)) and Path(sources).is_dir():
        paths = io.discover(sources)
    elif isinstance(sources, (str, os.PathLike)):
        paths = [os.fspath(sources)]
    else:
        paths = [os.fspath(s) for s in sources]
    load_opts = _load_options("distributed.batch", load)
    stems = [_stem(p) for p in paths]
    names = [s if stems.count(s) == 1 else f"{i:04d}_{s}" for i, s in enumerate(stems)]
    futs = []
    for p, name in zip(paths, names):
        opts = ssb(p) if callable(ssb) else ssb
        futs.append(
            client.submit(
                _acquisition_task,
                p,
                load_opts,
                tuple(products),
                bool(dpc),
                None if opts is None else dict(opts),
                None if out_dir is None else os.fspath(out_dir),
                name,
                pure=False,
                retries=retries,
            )
        )
    rows = []
    for p, f in zip(paths, futs):
        try:
            rows.append(f.result())
        except Exception as e:  # the worker itself died past its retries
            rows.append({"source": p, "ok": False, "error": str(e), "error_type": type(e).__name__})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------ GPUs


def local_gpu_cluster(
    gpus: Sequence[int] | int | None = None,
    workers_per_gpu: int = 1,
    threads_per_worker: int = 1,
    **kwargs,
):
    """A ``LocalCluster`` with one worker process per GPU (``workers_per_gpu`` per GPU when
    more), each started with ``CUDA_VISIBLE_DEVICES`` set to its GPU, so each worker's engine
    sees its GPU as device 0.

    ``gpus``: device indices, a count, or None for every device ``nvidia-smi -L`` lists.
    Returns a ``dask.distributed.SpecCluster``; ``Client(cluster)`` uses it.
    """
    import subprocess

    from distributed import Nanny, Scheduler, SpecCluster

    if gpus is None:
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            gpus = [i for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]
        except (OSError, subprocess.SubprocessError):
            gpus = []
    elif isinstance(gpus, int):
        gpus = list(range(gpus))
    if not gpus:
        raise _native.BackendUnavailableError("local_gpu_cluster: no GPU found (nvidia-smi -L)")
    workers = {}
    for g in gpus:
        for k in range(workers_per_gpu):
            workers[f"gpu{g}-{k}"] = {
                "cls": Nanny,
                "options": {
                    "nthreads": threads_per_worker,
                    "env": {"CUDA_VISIBLE_DEVICES": str(g)},
                },
            }
    scheduler = {
        "cls": Scheduler,
        "options": {"dashboard_address": kwargs.pop("dashboard_address", ":0")},
    }
    return SpecCluster(workers=workers, scheduler=scheduler, **kwargs)
