"""The ENCODED representation (CPU engine), .qem files and ``quantem-gpu convert``.

Expected values come from h5py + hdf5plugin (decode) and numpy (mask, uint64 block sums), never
from quantem.gpu itself.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from helpers import (
    DET,
    SCAN,
    bin_reference,
    console_script,
    counts,
    h5py_dectris,
    mask_array,
    masked,
    write_acquisition,
)

import quantem.gpu as qg
from quantem.gpu import io

ENCODED = io.DataRepresentation.ENCODED
DENSE = io.DataRepresentation.DENSE


@pytest.fixture(scope="module")
def acq16(tmp_path_factory):
    """5x7 scan, 11x13 uint16 frames (a few values near 60000), bad pixels."""
    tmp = tmp_path_factory.mktemp("enc16")
    data = counts(SCAN + DET, dtype=np.uint16, seed=7, high=60000)
    master, _, _ = write_acquisition(tmp, data=data, dtype=np.uint16, pixel_mask=mask_array())
    raw = h5py_dectris(master).reshape(SCAN + DET)
    np.testing.assert_array_equal(raw, data)
    return {"master": master, "raw": raw, "masked": masked(raw), "tmp": tmp}


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """6x8 scan of 64x64 uint16 frames of sparse counts (like a low-dose acquisition)."""
    tmp = tmp_path_factory.mktemp("sparse")
    data = counts((6, 8, 64, 64), dtype=np.uint16, seed=8, lam=0.3)
    master, _, _ = write_acquisition(tmp, data=data, dtype=np.uint16)
    raw = h5py_dectris(master).reshape(6, 8, 64, 64)
    np.testing.assert_array_equal(raw, data)
    return {"master": master, "raw": raw}


def test_encoded_equals_dense_and_h5py(acq16):
    with io.load(acq16["master"], backend="cpu", representation="encoded") as ds:
        assert ds.representation is ENCODED
        assert ds.shape == SCAN + DET and ds.dtype == np.uint16
        a = ds.to_numpy()
        np.testing.assert_array_equal(a, acq16["masked"])
        for r in range(SCAN[0]):
            for c in range(SCAN[1]):
                np.testing.assert_array_equal(ds[r, c], acq16["masked"][r, c], err_msg=f"{r},{c}")
        np.testing.assert_array_equal(ds[-1, -2], acq16["masked"][-1, -2])
        assert ds.provenance["representation"] == "encoded"
        assert ds.provenance["codec"]["name"] == "rans-counts v2"
        assert ds.provenance["codec"]["encoded_bytes"] == ds.nbytes_resident
    with io.load(acq16["master"], backend="cpu", representation=DENSE) as dense:
        assert dense.representation is DENSE
        np.testing.assert_array_equal(dense.to_numpy(), a)
    # The CPU default stays DENSE.
    with io.load(acq16["master"], backend="cpu") as d:
        assert d.representation is DENSE


def test_encoded_is_smaller_than_dense(sparse):
    with io.load(sparse["master"], backend="cpu", representation=ENCODED) as ds:
        dense_nbytes = sparse["raw"].nbytes
        assert 0 < ds.nbytes_resident < dense_nbytes / 2, (ds.nbytes_resident, dense_nbytes)
        np.testing.assert_array_equal(ds.to_numpy(), sparse["raw"])
        assert ds.provenance["codec"]["ratio_to_dense"] > 2


def test_encoded_regions_and_det_bin(acq16):
    sr, dr = (1, 4, 2, 7), (1, 10, 0, 12)
    with io.load(
        acq16["master"],
        backend="cpu",
        representation="encoded",
        scan_region=sr,
        detector_region=dr,
        det_bin=2,
        dtype="u16",
    ) as ds:
        want = bin_reference(acq16["masked"][1:4, 2:7, 1:10, 0:12], 2)
        assert want.max() <= 65535
        np.testing.assert_array_equal(ds.to_numpy(), want.astype(np.uint16))
        np.testing.assert_array_equal(ds[2, 4], want[2, 4].astype(np.uint16))
    with io.load(
        acq16["master"], backend="cpu", representation="encoded", det_bin=2, dtype="u8"
    ) as ds:
        assert ds.dtype == np.uint8
        want = np.minimum(bin_reference(acq16["masked"], 2), 255).astype(np.uint8)
        np.testing.assert_array_equal(ds.to_numpy(), want)


def test_u32_is_refused_with_advice(acquisition):
    # The session acquisition is uint32.
    with pytest.raises(qg.InvalidArgumentError, match="65535"):
        io.load(acquisition["master"], backend="cpu", representation="encoded")


def test_u32_source_narrowed_to_u16_encodes(acquisition):
    assert acquisition["masked"].max() <= 65535
    with io.load(acquisition["master"], backend="cpu", representation="encoded", dtype="u16") as ds:
        np.testing.assert_array_equal(ds.to_numpy(), acquisition["masked"].astype(np.uint16))


def test_numpy_source_encodes():
    data = counts((3, 4, 9, 7), dtype=np.uint16, seed=9, high=65000)
    with io.load(data, backend="cpu", representation="encoded") as ds:
        assert ds.representation is ENCODED
        np.testing.assert_array_equal(ds.to_numpy(), data)
        np.testing.assert_array_equal(ds[2, 3], data[2, 3])


def test_save_and_reload(acq16, tmp_path):
    out = tmp_path / "scan.qem"
    with io.load(acq16["master"], backend="cpu", representation="encoded") as ds:
        summary = io.save(ds, out)
        nbytes = ds.nbytes_resident
    assert summary["n_frames"] == SCAN[0] * SCAN[1]
    assert out.stat().st_size == summary["file_bytes"]
    with io.load(out, backend="cpu", representation="encoded") as back:
        assert back.representation is ENCODED
        assert back.shape == SCAN + DET and back.dtype == np.uint16
        assert back.nbytes_resident == nbytes
        np.testing.assert_array_equal(back.to_numpy(), acq16["masked"])
        np.testing.assert_array_equal(back[3, 5], acq16["masked"][3, 5])
        assert back.provenance["source_kind"] == "qem"
        orig = back.provenance["converted_from"]
        assert orig["files"][0]["path"].endswith("_master.h5")
    # A .qem stays ENCODED by default on every backend (DENSE when asked).
    with io.load(str(out), backend="cpu") as default:
        assert default.representation is ENCODED
    with io.load(str(out), backend="cpu", representation="dense") as dense:
        assert dense.representation is DENSE
        np.testing.assert_array_equal(dense.to_numpy(), acq16["masked"])
    # A dense dataset saves too.
    out2 = tmp_path / "dense.qem"
    with io.load(acq16["master"], backend="cpu") as d:
        io.save(d, out2)
    with io.load(out2, backend="cpu", representation="encoded") as back:
        np.testing.assert_array_equal(back.to_numpy(), acq16["masked"])
    with pytest.raises(qg.InvalidArgumentError):
        io.load(out, backend="cpu", scan_region=(0, 1, 0, 1))


def test_damaged_qem_raises_typed_errors(acq16, tmp_path):
    out = tmp_path / "good.qem"
    with io.load(acq16["master"], backend="cpu", representation="encoded") as ds:
        io.save(ds, out)
    good = out.read_bytes()
    bad = tmp_path / "bad.qem"

    def damaged(content, error, **kw) -> str:
        """Load ``content`` as bad.qem: an ``error`` naming that file; returns its message."""
        bad.write_bytes(bytes(content))
        with pytest.raises(error) as e:
            io.load(bad, backend="cpu", **kw)
        assert e.value.file.endswith("bad.qem")
        return str(e.value)

    truncated = good[: len(good) - 50]
    assert "truncated" in damaged(truncated, qg.SourceError, representation="encoded")

    # The writer puts the Streams section right after the header and table (byte 192).
    flipped = bytearray(good)
    flipped[300] ^= 0x04
    assert "Streams" in damaged(flipped, qg.DecodeError, representation="encoded")

    flipped = bytearray(good)
    flipped[20] ^= 0x80
    assert "header" in damaged(flipped, (qg.SourceError, qg.DecodeError))


def test_closed_dataset_cannot_be_saved(acq16, tmp_path):
    ds = io.load(acq16["master"], backend="cpu", representation="encoded")
    ds.close()
    with pytest.raises(qg.InvalidArgumentError):
        io.save(ds, tmp_path / "closed.qem")
    assert not (tmp_path / "closed.qem").exists()


def test_convert_command(sparse, tmp_path):
    exe = console_script()
    assert exe, "the quantem-gpu console script is not installed next to this Python"
    out = tmp_path / "conv.qem"
    run = subprocess.run(
        [exe, "convert", str(sparse["master"]), str(out), "--backend", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert run.returncode == 0, run.stderr
    rec = json.loads(run.stdout)
    assert rec["frames"] == 48
    assert rec["dense_bytes"] == sparse["raw"].nbytes
    assert rec["ratio_to_dense"] > 2
    with io.load(out, backend="cpu") as ds:
        np.testing.assert_array_equal(ds.to_numpy(), sparse["raw"])
    # A source that is not there: exit code 3 (bad input), nothing written.
    run = subprocess.run(
        [exe, "convert", str(tmp_path / "missing.h5"), str(tmp_path / "x.qem")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 3, (run.returncode, run.stderr)
    assert not (tmp_path / "x.qem").exists()
