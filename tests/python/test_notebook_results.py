"""Notebook display of every result type (``_repr_html_``, ``show()``) and ``progress=`` of
DPC and SSB (prepare and fit): the tqdm bar is created and ends at its total."""

from __future__ import annotations

import io as sio
import re

import numpy as np
import pytest
from disk_data import disk_data

import quantem.gpu as qg
from quantem.gpu import detector, dpc, io, ssb
from quantem.gpu._progress import TqdmProgress

SSB_ARGS = dict(voltage_kv=300.0, semiangle_mrad=20.0, scan_step_a=0.5)
FIT_ARGS = dict(global_evals=4, local_max_iter=3, local_starts=1)


@pytest.fixture(scope="module")
def data():
    return disk_data()


@pytest.fixture
def ds(data):
    return io.load(data, backend="cpu")


@pytest.fixture(scope="module")
def results(data):
    ds = io.load(data, backend="cpu")
    s = ssb.SSB(ds, **SSB_ARGS)
    return {
        "com": dpc.center_of_mass(ds),
        "dpc": dpc.run(ds),
        "ssb": s.reconstruct({"C10": 20.0}),
        "fit": s.fit(seed=0, **FIT_ARGS),
        "prepared": s,
        "products": detector.products(ds, ["bf", "sum_dp"]),
    }


def _cells(html: str) -> dict[str, str]:
    """``{row header: cell}`` of the summary table."""
    return dict(re.findall(r"<th style='text-align:left'>(.*?)</th><td[^>]*>(.*?)</td>", html))


@pytest.mark.parametrize(
    "key, title, arrays",
    [
        ("com", "CoM", {"com_row": "(8, 9) float64", "com_col": "(8, 9) float64"}),
        ("dpc", "DPCResult", {"phase": "(8, 9) float64", "dpc_col": "(8, 9) float64"}),
        ("ssb", "SSBResult", {"object": "(8, 9) complex128", "phase": "(8, 9) float64"}),
        ("fit", "SSBFit", {"loss_curve": "(44,) float64", "result.phase": "(8, 9) float64"}),
    ],
)
def test_repr_html_of_every_result(results, key, title, arrays):
    pytest.importorskip("matplotlib")
    r = results[key]
    h = r._repr_html_()
    cells = _cells(h)
    assert h.startswith(f"<div class='quantem-gpu'><b>{title}</b>")
    for name, text in arrays.items():
        assert cells[name] == text
    assert cells["backend"] == "cpu"
    assert cells["device"] == r.provenance["device"] and cells["device"]
    assert cells["arrays on"] == "host (numpy)"
    assert "provenance.operation" in cells
    assert "data:image/png;base64," in h  # thumbnail of the main image


def test_repr_html_counts_the_bytes_the_arrays_hold(results):
    c = results["com"]
    assert _cells(c._repr_html_())["resident"] == f"{2 * 8 * 9 * 8 / 1024:.1f} KiB"


def test_repr_html_without_matplotlib_is_the_table_alone(results, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    h = results["dpc"]._repr_html_()
    assert "DPCResult" in h and "base64" not in h
    with pytest.raises(ImportError, match="pip install matplotlib"):
        results["dpc"].show()


def test_prepared_ssb_and_disk_fit_have_a_summary(results, ds):
    cells = _cells(results["prepared"]._repr_html_())
    assert cells["n_bf"] == str(results["prepared"].info["n_bf"])
    assert cells["engine"] == "cpu"
    cells = _cells(detector.fit_disk(ds)._repr_html_())
    assert "radius_px" in cells and "center_px" in cells


@pytest.mark.parametrize(
    "key, which, want",
    [
        ("com", None, lambda r: r.com_row),
        ("com", "com_col", lambda r: r.com_col),
        ("dpc", None, lambda r: r.phase),
        ("dpc", "dpc_row", lambda r: r.dpc_row),
        ("ssb", None, lambda r: r.phase),
        ("ssb", "amplitude", lambda r: r.amplitude),
        ("ssb", "object", lambda r: np.angle(r.object)),
        ("fit", None, lambda r: r.result.phase),
        ("fit", "result.weak_phase", lambda r: r.result.weak_phase),
        ("products", None, lambda r: r["bf"].image),
        ("products", "sum_dp", lambda r: r["sum_dp"]),
    ],
)
def test_show_plots_the_named_image(results, key, which, want):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    r = results[key]
    ax = r.show() if which is None else r.show(which=which)
    got = np.asarray(ax.images[0].get_array())
    assert np.array_equal(got, np.asarray(want(r), dtype=np.float64))
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_show_draws_a_scale_bar_on_calibrated_axes(results):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from mpl_toolkits.axes_grid1.anchored_artists import AnchoredSizeBar

    ax = results["ssb"].show()  # scan step 0.5 Å: calibrated
    assert any(isinstance(a, AnchoredSizeBar) for a in ax.artists)
    ax = results["com"].show()  # no scan step: pixels, no bar
    assert not any(isinstance(a, AnchoredSizeBar) for a in ax.artists)


def test_show_refuses_an_unknown_image(results):
    pytest.importorskip("matplotlib")
    with pytest.raises(qg.InvalidArgumentError, match="which= names no 2-D image") as e:
        results["dpc"].show(which="loss")
    assert "phase" in e.value.expected
    with pytest.raises(qg.InvalidArgumentError, match="which=") as e:
        results["products"].show(which="adf")
    assert e.value.expected == "bf, sum_dp"


# ----------------------------------------------------------------------------- progress


class _Recorder:
    """Patched in for ``tqdm.auto.tqdm``: a text tqdm on a buffer that remembers its bars."""

    bars: list = []

    def __new__(cls, *args, **kwargs):
        from tqdm import tqdm

        kwargs["file"] = cls.buf
        kwargs["mininterval"] = 0
        bar = tqdm(*args, **kwargs)
        cls.bars.append(bar)
        return bar


@pytest.fixture
def recorder(monkeypatch):
    import tqdm.auto

    _Recorder.bars = []
    _Recorder.buf = sio.StringIO()
    monkeypatch.setattr(tqdm.auto, "tqdm", _Recorder)
    return _Recorder


def _ended(bar, desc: str, total: int) -> None:
    assert bar.desc.startswith(desc)
    assert bar.total == total and bar.n == total
    assert f"{desc}: 100%" in _Recorder.buf.getvalue()


def test_progress_true_for_dpc(data, recorder):
    ds = io.load(data, backend="cpu")
    com = dpc.center_of_mass(ds, progress=True)
    assert [b.desc for b in recorder.bars] == ["dpc.center_of_mass"]
    _ended(recorder.bars[0], "dpc.center_of_mass", 72)
    assert np.array_equal(com.com_row, dpc.center_of_mass(ds).com_row)
    recorder.bars.clear()
    r = dpc.run(ds, progress=True)
    assert recorder.bars and all(b.desc == "dpc.run" for b in recorder.bars)
    _ended(recorder.bars[-1], "dpc.run", 72)
    assert np.array_equal(r.phase, dpc.run(ds).phase)
    assert "dpc.run: 100%" in recorder.buf.getvalue()


def test_progress_true_for_ssb_prepare_and_fit(data, recorder):
    ds = io.load(data, backend="cpu")  # fresh: the mean-DP pass is not cached yet
    s = ssb.SSB(ds, **SSB_ARGS, progress=True)
    assert len(recorder.bars) == 1
    _ended(recorder.bars[0], "ssb prepare", 72)
    recorder.bars.clear()
    f = s.fit(seed=0, **FIT_ARGS, progress=True)
    assert len(recorder.bars) == 1
    _ended(recorder.bars[0], "ssb fit", f.evaluations)
    assert recorder.bars[0].unit == "eval"
    g = s.fit(seed=0, **FIT_ARGS)
    assert g.aberrations == f.aberrations and g.loss == f.loss


def test_progress_callable_and_refusals(ds):
    calls = []
    s = ssb.SSB(ds, **SSB_ARGS, progress=lambda *a: calls.append(a))
    assert calls[-1] == ("ssb prepare", 72, 72)
    calls.clear()
    f = s.fit(seed=0, **FIT_ARGS, progress=lambda *a: calls.append(a))
    assert calls[-1] == ("ssb fit", f.evaluations, f.evaluations)
    with pytest.raises(qg.ArgumentTypeError, match="progress"):
        dpc.run(ds, progress="yes")
    with pytest.raises(qg.ArgumentTypeError, match="progress"):
        s.fit(progress=1)


def test_progress_callback_error_stops_the_fit(ds):
    s = ssb.SSB(ds, **SSB_ARGS)

    def boom(stage, done, total):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        s.fit(seed=0, **FIT_ARGS, progress=boom)


def test_text_bar_on_a_stream(ds):
    buf = sio.StringIO()
    dpc.center_of_mass(ds, progress=TqdmProgress(file=buf, mininterval=0))
    out = buf.getvalue().replace(".0", "")
    assert "dpc.center_of_mass: 100%" in out and "72/72" in out
