"""Notebook helpers: NumPy-style slicing (byte-exact against the dense array), _repr_html_,
show() with matplotlib's Agg backend, and tqdm progress bars on a captured stream."""

import io as sio

import numpy as np
import pytest

from quantem.gpu import detector, io
from quantem.gpu._progress import TqdmProgress

KEYS = [
    (slice(0, 3), slice(None), 2, 3),
    (Ellipsis, 2, 3),
    (1, 2),
    (slice(None), -1),
    (np.int64(3), Ellipsis),
    (slice(1, 6, 2), slice(None, None, -2), slice(1, 4), 0),
]


@pytest.fixture(params=["dense", "encoded"])
def pair(request):
    a = np.random.default_rng(0).integers(0, 900, (7, 9, 5, 6), dtype=np.uint16)
    return a, io.load(a, backend="cpu", representation=request.param)


@pytest.mark.parametrize("key", KEYS, ids=range(len(KEYS)))
def test_slicing_matches_numpy_byte_exact(pair, key):
    a, ds = pair
    got = ds[key]
    assert got.dtype == a.dtype and np.array_equal(got, a[key])


@pytest.mark.parametrize("key", [(7, 0), (0, -10), (0, 0, 0, 6), (0, 0, 5)])
def test_out_of_range_index_is_an_index_error(pair, key):
    with pytest.raises(IndexError, match="out of range"):
        pair[1][key]


def test_repr_html_and_show(pair):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    a, ds = pair
    h = ds._repr_html_()
    assert "(7, 9, 5, 6)" in h and "uint16" in h and ">cpu<" in h
    img = detector.bf(ds)
    h = img._repr_html_()
    assert "data:image/png;base64," in h and "DetectorImage" in h
    ax = img.show()
    assert np.array_equal(ax.images[0].get_array(), img.image.astype(np.float64))
    assert ds.show().images[0].get_array().shape == (5, 6)


def test_progress_draws_a_tqdm_bar_per_pass(pair):
    a, ds = pair
    buf = sio.StringIO()
    img = detector.bf(ds, progress=TqdmProgress(file=buf, mininterval=0))
    assert np.array_equal(img.image, detector.bf(ds).image)
    out = buf.getvalue()
    assert "detector.bf: 100%" in out and "63/63" in out.replace(".0", "")
