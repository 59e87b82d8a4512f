"""Test data: acquisitions written by an independent writer, read back by h5py.

Expected values always come from h5py + hdf5plugin (or numpy), never from quantem.gpu itself.
The Dectris writer is ``tests/tools/make_dectris.py`` (h5py + hdf5plugin + numpy only; it does
not import quantem).
"""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if not (TOOLS / "make_dectris.py").is_file():
    raise RuntimeError(
        f"the independent test-data writer is missing: expected {TOOLS / 'make_dectris.py'}"
    )
sys.path.insert(0, str(TOOLS))

import make_dectris  # noqa: E402

# A rectangular scan (rows != cols), an odd detector (143 pixels: 7 left over after the
# bitshuffle blocks of 8), uint32 counts, shards of 8 frames (8, 8, 8, 8, 3).
SCAN = (5, 7)
DET = (11, 13)
FRAMES_PER_FILE = 8
#: (row, col) -> pixel_mask value; the low 16 bits mark a pixel bad, higher bits do not.
MASK_ENTRIES = {
    (0, 0): 1,  # gap pixel
    (3, 4): 2,  # dead
    (5, 12): 4,  # under-responding
    (10, 1): 0x10,  # noisy
    (7, 7): 0x8000,  # highest low bit
    (2, 9): 1 << 31,  # only a high bit: NOT bad
    (6, 2): 1 << 16,  # only a high bit: NOT bad
}
BAD_PIXELS = [rc for rc, v in MASK_ENTRIES.items() if v & 0xFFFF]
HIGH_BIT_ONLY = [rc for rc, v in MASK_ENTRIES.items() if not v & 0xFFFF]


def bslz4(nelems: int = 0) -> dict:
    """h5py keyword arguments for bitshuffle + LZ4 (filter 32008)."""
    return dict(hdf5plugin.Bitshuffle(nelems=nelems, cname="lz4"))


def counts(shape, dtype=np.uint32, seed=0, lam=3.0, high=None) -> np.ndarray:
    """Poisson counts with a few large values sprinkled in (so nothing is trivially 0)."""
    rng = np.random.default_rng(seed)
    a = rng.poisson(lam, size=shape).astype(np.uint64)
    if high is not None:
        flat = a.reshape(-1)
        idx = rng.choice(flat.size, size=max(1, flat.size // 50), replace=False)
        flat[idx] = rng.integers(high // 2, high, size=idx.size)
    return a.astype(dtype)


def h5py_dectris(master: Path) -> np.ndarray:
    """All frames of a Dectris acquisition, decoded by h5py (concatenated over the shards)."""
    with h5py.File(master, "r") as f:
        g = f["/entry/data"]
        names = sorted(n for n in g if n.startswith("data_"))
        return np.concatenate([g[n][...] for n in names])


def mask_array(shape=DET) -> np.ndarray:
    m = np.zeros(shape, np.uint32)
    for rc, v in MASK_ENTRIES.items():
        m[rc] = v
    return m


def write_acquisition(
    tmp_path: Path, name="scan", data=None, dtype=np.uint32, fpf=FRAMES_PER_FILE, pixel_mask=None
):
    """Write a Dectris acquisition; returns (master path, data files, the data as written)."""
    if data is None:
        data = counts(SCAN + DET, dtype=dtype, high=5000)
    res = make_dectris.write_dectris(
        str(tmp_path / name), data, frames_per_file=fpf, dtype=dtype, pixel_mask=pixel_mask
    )
    return Path(res["master"]), [Path(p) for p in res["data_files"]], data


def bin_reference(a: np.ndarray, b: int) -> np.ndarray:
    """Sum b x b detector blocks in uint64; incomplete edge blocks sum the pixels that exist."""
    kr, kc = a.shape[-2:]
    out_r, out_c = -(-kr // b), -(-kc // b)
    padded = np.zeros(a.shape[:-2] + (out_r * b, out_c * b), np.uint64)
    padded[..., :kr, :kc] = a
    return padded.reshape(a.shape[:-2] + (out_r, b, out_c, b)).sum(axis=(-3, -1), dtype=np.uint64)


def masked(raw: np.ndarray) -> np.ndarray:
    """``raw`` with the BAD_PIXELS of every frame set to 0 (what a masked load must return)."""
    out = raw.copy()
    for rc in BAD_PIXELS:
        out[(..., *rc)] = 0
    return out


def console_script() -> str | None:
    """The ``quantem-gpu`` console script next to this Python, else the one on PATH, else None."""
    import shutil

    beside = Path(sys.executable).with_name("quantem-gpu")
    return str(beside) if beside.exists() else shutil.which("quantem-gpu")
