"""Malformed sources: each gives a typed exception naming the file and, where it applies, the frame.

Every corruption is made with h5py on a file written by the independent writer, and h5py's own
reading of the damaged frame is checked to fail or differ, so the test knows the damage is real.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from helpers import FRAMES_PER_FILE, SCAN, bslz4, counts, write_acquisition

import quantem.gpu as qg
from quantem.gpu import io

# Damage local frame 2 of the second shard: global frame 8 + 2 = 10.
SHARD, LOCAL = 1, 2
GLOBAL = SHARD * FRAMES_PER_FILE + LOCAL


def damage_chunk(shard_path, local_frame, mutate):
    """Replace one stored chunk with mutate(raw bytes); return (original frame, h5py's verdict)."""
    with h5py.File(shard_path, "r+") as f:
        d = f["/entry/data/data"]
        original = d[local_frame]
        mask, raw = d.id.read_direct_chunk((local_frame, 0, 0))
        info = d.id.get_chunk_info_by_coord((local_frame, 0, 0))
        assert info.size == len(raw)
        d.id.write_direct_chunk((local_frame, 0, 0), mutate(bytes(raw)), filter_mask=mask)
    try:
        with h5py.File(shard_path, "r") as f:
            after = f["/entry/data/data"][local_frame]
        h5py_verdict = "differs" if not np.array_equal(after, original) else "same"
    except Exception:  # h5py / HDF5 filter error
        h5py_verdict = "fails"
    return original, h5py_verdict


def assert_names(err, file_name, frame=None):
    msg = str(err)
    assert file_name in msg or file_name in str(err.file), (file_name, msg)
    if frame is not None:
        assert err.frame == frame or f"frame {frame}" in msg, (frame, msg, err.frame)


def test_truncated_chunk(tmp_path):
    master, files, _ = write_acquisition(tmp_path)
    _, verdict = damage_chunk(files[SHARD], LOCAL, lambda raw: raw[: len(raw) // 2])
    assert verdict == "fails", "h5py should fail on a chunk cut in half"
    with pytest.raises(qg.DecodeError) as e:
        io.load(master, scan_shape=SCAN)
    assert_names(e.value, files[SHARD].name, GLOBAL)


def test_chunk_of_zero_bytes_past_header(tmp_path):
    master, files, _ = write_acquisition(tmp_path)
    _, verdict = damage_chunk(files[SHARD], LOCAL, lambda raw: raw[:12])
    assert verdict in ("fails", "differs")
    with pytest.raises(qg.DecodeError) as e:
        io.load(master, scan_shape=SCAN)
    assert_names(e.value, files[SHARD].name, GLOBAL)


def test_corrupt_lz4_block(tmp_path):
    master, files, _ = write_acquisition(tmp_path)

    def corrupt(raw):
        b = bytearray(raw)
        # chunk = u64 total | u32 block bytes | (u32 length | LZ4 block)*: overwrite the start
        # of the first LZ4 block with 0xFF (a literal run far longer than the block).
        clen = int.from_bytes(b[12:16], "big")
        n = min(clen, 64)
        b[16 : 16 + n] = b"\xff" * n
        return bytes(b)

    _, verdict = damage_chunk(files[SHARD], LOCAL, corrupt)
    assert verdict in ("fails", "differs"), "the corruption must be visible to h5py too"
    with pytest.raises(qg.DecodeError) as e:
        io.load(master, scan_shape=SCAN)
    assert_names(e.value, files[SHARD].name, GLOBAL)


def test_truncated_shard_file(tmp_path):
    master, files, _ = write_acquisition(tmp_path)
    size = files[SHARD].stat().st_size
    with open(files[SHARD], "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises((qg.SourceError, qg.DecodeError, qg.QuantemIOError)) as e:
        io.load(master, scan_shape=SCAN)
    assert_names(e.value, files[SHARD].name)


def test_missing_shard(tmp_path):
    master, files, _ = write_acquisition(tmp_path)
    files[SHARD].unlink()
    with pytest.raises(qg.SourceError) as e:
        io.load(master, scan_shape=SCAN)
    assert files[SHARD].name in str(e.value)
    report = io.inspect(master, scan_shape=SCAN)
    assert report["ready"] is False
    assert files[SHARD].name in json.dumps(report.get("missing_shards", report))
    assert report.get("reason")


def test_inspect_ready_source(tmp_path):
    master, files, _ = write_acquisition(tmp_path)
    report = io.inspect(master, scan_shape=SCAN)
    assert report["ready"] is True
    assert report["missing_shards"] == [] and report["missing_frames"] == []
    text = json.dumps(report)
    assert '"rows": 5' in text and '"cols": 7' in text


def test_discover(tmp_path):
    write_acquisition(tmp_path / "a", name="first")
    write_acquisition(tmp_path / "b" / "c", name="second")
    (tmp_path / "b" / "notes.h5").write_bytes(b"")
    (tmp_path / "b" / "second_data_000001.h5.bak").write_bytes(b"")
    found = io.discover(tmp_path)
    assert [p.rsplit("/", 1)[-1] for p in found] == ["first_master.h5", "second_master.h5"]


def test_wrong_scan_shape(tmp_path):
    master, _, _ = write_acquisition(tmp_path)
    with pytest.raises((qg.SourceError, qg.InvalidArgumentError)) as e:
        io.load(master, scan_shape=(6, 7))
    err = e.value
    assert err.expected and err.found
    assert "35" in str(err) and "42" in str(err), str(err)


def test_unwritten_chunks(tmp_path):
    p = tmp_path / "unwritten.h5"
    data = counts((10, 8, 8), np.uint16, seed=12)
    with h5py.File(p, "w") as f:
        d = f.create_dataset(
            "/data", shape=(10, 8, 8), dtype=np.uint16, chunks=(1, 8, 8), **bslz4()
        )
        d[0:6] = data[0:6]
        d[7] = data[7]
    with h5py.File(p, "r") as f:
        d = f["/data"]
        written = {d.id.get_chunk_info(i).chunk_offset[0] for i in range(d.id.get_num_chunks())}
    assert written == {0, 1, 2, 3, 4, 5, 7}
    with pytest.raises(qg.SourceError) as e:
        io.load(p, scan_shape=(2, 5), dataset_path="/data")
    assert_names(e.value, "unwritten.h5", 6)
    report = io.inspect(p, scan_shape=(2, 5))
    assert report["ready"] is False
    assert {6, 8, 9} <= set(report["missing_frames"])
    assert report["n_missing_frames"] == 3


def test_not_hdf5(tmp_path):
    p = tmp_path / "junk_master.h5"
    p.write_bytes(b"this is not an HDF5 file" * 10)
    with pytest.raises((qg.SourceError, qg.QuantemIOError)) as e:
        io.load(p, scan_shape=(2, 2))
    assert "junk_master.h5" in str(e.value)
