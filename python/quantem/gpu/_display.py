"""Notebook display of datasets and results: ``_repr_html_`` and ``.show()``.

``_repr_html_`` is a small table (shape, dtype, backend, device, resident bytes, a provenance
summary) and, for images, an inline PNG thumbnail (written with matplotlib when it is
installed; without it the table alone). ``show()`` plots with matplotlib and says how to
install it when it is missing.
"""

from __future__ import annotations

import base64
import html
import io as _io
from typing import Any

import numpy as np

#: Longest side of an inline thumbnail, pixels.
THUMB_PX = 160


def _bytes_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n} B"  # pragma: no cover


def _matplotlib(op: str):
    try:
        import matplotlib

        return matplotlib
    except ImportError:
        raise ImportError(
            f"{op} plots with matplotlib, which is not installed; "
            "install it with `pip install matplotlib`"
        ) from None


def thumbnail_png(image: np.ndarray) -> bytes | None:
    """A PNG of a 2-D image scaled to at most :data:`THUMB_PX` per side (1st–99th percentile
    display range), or None without matplotlib or for non-finite images."""
    try:
        import matplotlib.image as mpimg
    except ImportError:
        return None
    a = np.asarray(image)
    if np.iscomplexobj(a):
        a = np.angle(a)
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.size == 0:
        return None
    step = max(1, int(np.ceil(max(a.shape) / THUMB_PX)))
    a = a[::step, ::step]
    finite = a[np.isfinite(a)]
    if finite.size == 0:
        return None
    lo, hi = np.percentile(finite, [1.0, 99.0])
    if hi <= lo:
        hi = lo + 1.0
    scaled = np.clip((np.nan_to_num(a, nan=lo) - lo) / (hi - lo), 0.0, 1.0)
    buf = _io.BytesIO()
    mpimg.imsave(buf, scaled, cmap="gray", vmin=0.0, vmax=1.0, format="png")
    return buf.getvalue()


def _provenance_rows(prov: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not prov:
        return []
    rows = []
    for key in ("operation", "backend", "representation", "source", "files", "git_revision"):
        v = prov.get(key)
        if v in (None, "", [], {}):
            continue
        if isinstance(v, list):
            v = f"{v[0]}" + (f" (+{len(v) - 1} more)" if len(v) > 1 else "")
        rows.append((f"provenance.{key}", str(v)))
    ds = prov.get("dataset")
    if isinstance(ds, dict):
        rows += [(f"dataset.{k}", v) for k, v in _provenance_rows(ds) if "." in k]
    timings = prov.get("timings")
    if isinstance(timings, list) and timings:
        total = sum(float(t.get("seconds", 0.0)) for t in timings if isinstance(t, dict))
        rows.append(("provenance.seconds", f"{total:.3g} over {len(timings)} stages"))
    return rows


def table_html(title: str, rows: list[tuple[str, Any]], image: np.ndarray | None = None) -> str:
    """An HTML table of ``rows`` under ``title``, with a thumbnail of ``image`` beside it."""
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    thumb = ""
    if image is not None:
        png = thumbnail_png(image)
        if png is not None:
            b64 = base64.b64encode(png).decode("ascii")
            thumb = (
                f"<td style='vertical-align:top'><img alt='thumbnail' "
                f"src='data:image/png;base64,{b64}'/></td>"
            )
    return (
        f"<div class='quantem-gpu'><b>{html.escape(title)}</b>"
        f"<table><tr><td style='vertical-align:top'><table>{body}</table></td>{thumb}</tr>"
        f"</table></div>"
    )


def dataset_html(ds) -> str:
    """``Dataset._repr_html_``."""
    rows: list[tuple[str, Any]] = [
        ("shape", tuple(ds.shape)),
        ("dtype", ds.dtype),
        ("representation", ds.representation.value),
        ("backend", ds.backend),
        ("device", ds.device),
        ("resident", _bytes_text(int(ds.nbytes_resident))),
    ]
    if ds.closed:
        rows.append(("state", "closed"))
        return table_html("Dataset", rows)
    cal = getattr(ds, "calibration", None)
    if cal is not None:
        for name, d in cal.as_dict().items():
            if d["value"] is not None:
                rows.append((f"calibration.{name}", f"{d['value']} {d['unit']} ({d['source']})"))
    rows += _provenance_rows(ds.provenance)
    return table_html("Dataset", rows)


def _main_array(result) -> tuple[str, np.ndarray | None]:
    for name in ("image", "phase"):
        a = getattr(result, name, None)
        if isinstance(a, np.ndarray):
            return name, a
    res = getattr(result, "result", None)
    if res is not None and isinstance(getattr(res, "phase", None), np.ndarray):
        return "result.phase", res.phase
    a = getattr(result, "com_row", None)
    if isinstance(a, np.ndarray):
        return "com_row", a
    return "", None


def _named_array(obj, which: str) -> np.ndarray:
    """The array ``which`` names on ``obj`` (an attribute, ``result.<attr>`` of a fit, or a
    product of :class:`~quantem.gpu.detector.Products`)."""
    target = obj
    name = which
    if which.startswith("result.") and hasattr(obj, "result"):
        target, name = obj.result, which[len("result.") :]
    if isinstance(target, dict) and name in target:
        v = target[name]
        v = v if isinstance(v, np.ndarray) else _main_array(v)[1]
    else:
        v = getattr(target, name, None)
    if not isinstance(v, np.ndarray) or v.ndim != 2:
        if isinstance(obj, dict):  # Products
            cands = [
                (k, v if isinstance(v, np.ndarray) else _main_array(v)[1]) for k, v in obj.items()
            ]
        else:
            cands = _arrays(obj)
        names = ", ".join(n for n, v in cands if v is not None and v.ndim == 2)
        from quantem.gpu import _args

        raise _args.invalid(
            "show", "which= names no 2-D image of the result", names or "none", repr(which)
        )
    return v


def _arrays(result) -> list[tuple[str, np.ndarray]]:
    """Every array attribute of a result (a fit's reconstruction included), in field order."""
    out: list[tuple[str, np.ndarray]] = []
    names = getattr(result, "__dataclass_fields__", None) or {}
    for n in names:
        v = getattr(result, n, None)
        if isinstance(v, np.ndarray):
            out.append((n, v))
    inner = getattr(result, "result", None)
    if inner is not None and inner is not result:
        out += [(f"result.{n}", v) for n, v in _arrays(inner)]
    return out


def _device_arrays(result) -> list[tuple[str, Any]]:
    """Every field of a result that holds a :class:`~quantem.gpu.results.DeviceArray`
    (``device_result=True``), in field order."""
    from quantem.gpu.results import DeviceArray

    names = getattr(result, "__dataclass_fields__", None) or {}
    return [(n, v) for n in names if isinstance(v := getattr(result, n, None), DeviceArray)]


def _where(prov: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``backend`` and ``device`` rows from a result's provenance (where it ran)."""
    if not isinstance(prov, dict):
        return []
    rows = []
    for key in ("backend", "device"):
        v = prov.get(key)
        if v not in (None, ""):
            rows.append((key, str(v)))
    return rows


def units_axes_summary_rows(result) -> list[tuple[str, str]]:
    """The ``units`` and ``axes`` rows of a result (where it has them) and its ``summary`` (the
    repr), as :func:`result_html` shows them."""
    rows = []
    units = getattr(result, "units", None)
    if isinstance(units, dict) and units:
        rows.append(("units", ", ".join(f"{k}: {v}" for k, v in units.items())))
    axes = getattr(result, "axes", None)
    if isinstance(axes, tuple) and axes:
        rows.append(("axes", ", ".join(f"{x.name} {x.scale:.4g} {x.units}" for x in axes)))
    rows.append(("summary", repr(result)))
    return rows


def result_html(result) -> str:
    """``_repr_html_`` of a result (DetectorImage, CoM, DPCResult, SSBResult, SSBFit): every
    array's shape and dtype, where it ran (backend, device), where the arrays live (host
    NumPy) and their bytes, the repr, the provenance summary and a thumbnail of the main
    image."""
    name, a = _main_array(result)
    arrays = _arrays(result)
    on_card = _device_arrays(result)
    rows: list[tuple[str, Any]] = [(f"{n}", f"{v.shape} {v.dtype}") for n, v in arrays]
    rows += [(n, f"{tuple(v.shape)} {v.dtype}") for n, v in on_card]
    prov = getattr(result, "provenance", None)
    rows += _where(prov)
    if arrays:
        rows += [
            ("arrays on", "host (numpy)"),
            ("resident", _bytes_text(int(sum(v.nbytes for _, v in arrays)))),
        ]
    if on_card:
        # No thumbnail of these: drawing one would copy the image to the host.
        rows += [
            ("arrays on", f"cuda:{on_card[0][1].device} (device_result=True)"),
            ("resident on the card", _bytes_text(int(sum(v.nbytes for _, v in on_card)))),
        ]
    rows += units_axes_summary_rows(result)
    rows += [(k, v) for k, v in _provenance_rows(prov) if k != "provenance.backend"]
    return table_html(type(result).__name__, rows, a if a is not None and a.ndim == 2 else None)


def info_html(obj) -> str:
    """``_repr_html_`` of an object without arrays of its own (the prepared SSB, a disk fit):
    its repr, its dataclass fields and the scalar entries of its ``info``."""
    rows: list[tuple[str, Any]] = [("summary", repr(obj))]
    for f in getattr(obj, "__dataclass_fields__", {}):
        rows.append((f, getattr(obj, f)))
    info = getattr(obj, "info", None)
    if isinstance(info, dict):
        for k, v in info.items():
            if isinstance(v, (str, int, float, bool)) or (
                isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)
            ):
                rows.append((k, v))
            elif isinstance(v, np.ndarray):
                rows.append((k, f"{v.shape} {v.dtype}"))
    return table_html(type(obj).__name__, rows)


def products_html(products) -> str:
    """``Products._repr_html_``: one row per product."""
    rows: list[tuple[str, Any]] = []
    first_image = None
    for k, v in products.items():
        name, a = _main_array(v) if not isinstance(v, np.ndarray) else (k, v)
        if a is not None:
            rows.append((k, f"{a.shape} {a.dtype}"))
            if first_image is None and a.ndim == 2:
                first_image = a
        else:
            rows.append((k, type(v).__name__))
    rows += _provenance_rows(getattr(products, "provenance", None))
    return table_html("Products", rows, first_image)


def show(
    obj,
    ax=None,
    cmap: str = "gray",
    title: str | None = None,
    *,
    which: str | None = None,
    **imshow_kwargs,
):
    """Plot a result's image (or a dataset's mean diffraction pattern) with matplotlib.

    ``which`` names the image (``"weak_phase"``, ``"com_col"``, ``"result.amplitude"`` of a
    fit, a product's name); default the main one: the detector image, the phase of DPC and
    SSB (a fit's reconstruction), ``com_row`` of a CoM, the first image of products. Complex
    arrays are shown as their phase; a calibrated column axis gets a scale bar.

    Returns the matplotlib ``Axes``. Raises ``ImportError`` naming the package when matplotlib
    is missing.
    """
    _matplotlib("show()")
    import matplotlib.pyplot as plt

    if hasattr(obj, "nbytes_resident"):  # a Dataset: its mean diffraction pattern
        from quantem.gpu import detector

        name, a = "mean_dp", detector.mean_dp(obj)
    elif which is not None:
        name, a = which, _named_array(obj, which)
    elif isinstance(obj, dict):  # Products: the first 2-D image
        name, a = next(
            (
                (k, arr)
                for k, v in obj.items()
                for arr in [v if isinstance(v, np.ndarray) else _main_array(v)[1]]
                if arr is not None and arr.ndim == 2
            ),
            ("", None),
        )
    else:
        name, a = _main_array(obj)
    if a is None:
        raise TypeError(f"{type(obj).__name__} holds no image to show")
    if np.iscomplexobj(a):
        a = np.angle(a)
    if ax is None:
        _, ax = plt.subplots()
    im = ax.imshow(np.asarray(a, dtype=np.float64), cmap=cmap, **imshow_kwargs)
    ax.set_title(title if title is not None else f"{type(obj).__name__}: {name}")
    ax.figure.colorbar(im, ax=ax)
    _scale_bar(obj, name, a, ax)
    return ax


def _scale_bar(obj, name: str, a: np.ndarray, ax) -> None:
    """A scale bar along the column axis when the image's axes are calibrated."""
    axes = getattr(obj, "axes", None)
    if isinstance(axes, dict):  # Products: axes per product
        axes = axes.get(name)
    elif name.startswith("result."):
        axes = getattr(getattr(obj, "result", None), "axes", None)
    if not isinstance(axes, tuple) or len(axes) != 2 or axes[1].size != a.shape[1]:
        return
    if axes[1].calibrated:
        from quantem.gpu import results

        results.add_scale_bar(ax, axes[1])


def attach(*classes: type, html=result_html, plot=show) -> None:
    """Give each class ``_repr_html_`` (``html``) and, when ``plot`` is not None, ``show``,
    where it has none of its own (``quantem.gpu`` calls it for the result classes of modules
    that do not import this one)."""
    for cls in classes:
        if "_repr_html_" not in cls.__dict__:
            cls._repr_html_ = html
        if plot is not None and "show" not in cls.__dict__:
            cls.show = plot
