"""Loading a Dectris master + shards, compared with h5py's own decode."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BAD_PIXELS, DET, HIGH_BIT_ONLY, SCAN

import quantem.gpu as qg
from quantem.gpu import device, io


@pytest.fixture(scope="module")
def loaded(acquisition):
    with io.load(acquisition["master"], scan_shape=SCAN) as ds:
        yield ds


def test_whole_array_matches_h5py(loaded, acquisition):
    assert loaded.shape == SCAN + DET
    assert loaded.dtype == np.uint32
    a = loaded.to_numpy()
    assert a.shape == SCAN + DET and a.dtype == np.uint32
    np.testing.assert_array_equal(a, acquisition["masked"])


def test_every_frame_matches_h5py(loaded, acquisition):
    expected = acquisition["masked"]
    for r in range(SCAN[0]):
        for c in range(SCAN[1]):
            f = loaded[r, c]
            assert f.shape == DET and f.dtype == np.uint32
            np.testing.assert_array_equal(f, expected[r, c], err_msg=f"frame ({r}, {c})")


def test_frame_indexing_like_numpy(loaded, acquisition):
    expected = acquisition["masked"]
    np.testing.assert_array_equal(loaded[-1, -1], expected[-1, -1])
    np.testing.assert_array_equal(loaded[-5, 3], expected[-5, 3])
    for idx in [(SCAN[0], 0), (0, SCAN[1]), (-SCAN[0] - 1, 0), (0, -SCAN[1] - 1)]:
        with pytest.raises(IndexError):
            loaded[idx]
    # NumPy-style partial indexing reads only the selected frames.
    np.testing.assert_array_equal(loaded[0], expected[0])
    np.testing.assert_array_equal(loaded[0:2, 0], expected[0:2, 0])
    with pytest.raises(TypeError):
        loaded[0.5, 0]


def test_bad_pixels_zero_only_for_low_16_bits(loaded, acquisition):
    raw = acquisition["raw"]
    a = loaded.to_numpy()
    for rc in BAD_PIXELS:
        assert raw[(..., *rc)].any(), "test data must have counts at the bad pixels"
        assert not a[(..., *rc)].any(), f"bad pixel {rc} not zeroed"
    for rc in HIGH_BIT_ONLY:
        np.testing.assert_array_equal(a[(..., *rc)], raw[(..., *rc)], err_msg=f"pixel {rc}")


def test_apply_mask_false_gives_raw_counts(acquisition):
    with io.load(acquisition["master"], scan_shape=SCAN, apply_mask=False) as ds:
        np.testing.assert_array_equal(ds.to_numpy(), acquisition["raw"])
        assert ds.provenance["mask_policy"]["applied"] is False


def test_np_asarray_and_metadata(loaded, acquisition):
    np.testing.assert_array_equal(np.asarray(loaded), acquisition["masked"])
    np.testing.assert_array_equal(
        np.asarray(loaded, dtype=np.float64), acquisition["masked"].astype(np.float64)
    )
    md = loaded.metadata
    assert isinstance(md, dict)
    assert md["detector_shape"] == {"rows": DET[0], "cols": DET[1]}
    assert md["n_frames"] == SCAN[0] * SCAN[1]
    prov = loaded.provenance
    # auto: CUDA on a GPU machine, else the CPU
    assert prov["backend"] == loaded.backend == device.resolve("auto")
    assert prov["result_dtype"] == "u32" and prov["source_dtype"] == "u32"
    assert prov["mask_policy"]["applied"] is True
    assert prov["mask_policy"]["bad_pixels"] == len(BAD_PIXELS)
    files = " ".join(str(f["path"]) for f in prov["files"])
    for shard in acquisition["files"]:
        assert shard.name in files
    assert isinstance(loaded.device, str) and loaded.device


def test_representation_and_repr(loaded):
    assert loaded.representation is io.DataRepresentation.DENSE
    r = repr(loaded)
    assert "(5, 7, 11, 13)" in r and "uint32" in r and loaded.backend in r and "dense" in r
    assert loaded.nbytes_resident == 5 * 7 * 11 * 13 * 4


def test_representation_argument(acquisition):
    for rep in ("dense", io.DataRepresentation.DENSE):
        with io.load(acquisition["master"], scan_shape=SCAN, representation=rep) as ds:
            assert ds.representation is io.DataRepresentation.DENSE
    with pytest.raises(TypeError):
        io.load(acquisition["master"], scan_shape=SCAN, representation=3)


def test_encoded_never_silently_dense(acquisition):
    try:
        ds = io.load(acquisition["master"], scan_shape=SCAN, representation="encoded")
    except qg.InvalidArgumentError as e:
        assert "encoded" in str(e).lower() or "Encoded" in str(e)
        return
    with ds:
        assert ds.representation is io.DataRepresentation.ENCODED
        np.testing.assert_array_equal(ds[2, 3], ds.to_numpy()[2, 3])


def test_close_releases_and_later_access_raises(acquisition):
    ds = io.load(acquisition["master"], scan_shape=SCAN)
    assert ds.nbytes_resident > 0
    ds.close()
    assert ds.nbytes_resident == 0
    with pytest.raises(qg.InvalidArgumentError):
        ds[0, 0]
    with pytest.raises(qg.InvalidArgumentError):
        ds.to_numpy()
    assert "closed" in repr(ds)
    ds.close()  # idempotent


def test_context_manager_closes(acquisition):
    with io.load(acquisition["master"], scan_shape=SCAN) as ds:
        ds[0, 0]
    assert ds.nbytes_resident == 0
    with pytest.raises(qg.QuantemError):
        ds[0, 0]


def test_pathlike_source(acquisition):
    with (
        io.load(acquisition["master"], scan_shape=SCAN) as a,
        io.load(str(acquisition["master"]), scan_shape=SCAN) as b,
    ):
        np.testing.assert_array_equal(a[1, 2], b[1, 2])


def test_scan_shape_from_file(acquisition):
    # make_dectris records /entry/instrument/stem/scan_shape; without it 35 frames is not a square.
    with io.load(acquisition["master"]) as ds:
        assert ds.shape == SCAN + DET
        np.testing.assert_array_equal(ds[4, 6], acquisition["masked"][4, 6])


def test_progress_callback_reports_stages(acquisition):
    calls = []
    with io.load(acquisition["master"], scan_shape=SCAN, progress=lambda *a: calls.append(a)):
        pass
    assert calls, "the progress callback was never called"
    for stage, done, total in calls:
        assert isinstance(stage, str) and 0 <= done and 0 <= total


def test_progress_true_writes_to_stderr(acquisition, capsys):
    with io.load(acquisition["master"], scan_shape=SCAN, progress=True):
        pass
    assert capsys.readouterr().err.strip()


def test_progress_callback_exception_stops_the_load(acquisition):
    class Stop(Exception):
        pass

    def cb(stage, done, total):
        raise Stop(stage)

    with pytest.raises(Stop):
        io.load(acquisition["master"], scan_shape=SCAN, progress=cb)


def test_keyboard_interrupt_during_load(acquisition):
    # Ctrl-C arrives as SIGINT while the load runs; it must surface as KeyboardInterrupt.
    import os
    import signal

    sent = []

    def cb(stage, done, total):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        io.load(acquisition["master"], scan_shape=SCAN, progress=cb)
