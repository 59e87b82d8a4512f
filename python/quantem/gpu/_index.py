"""NumPy-style indexing of a dataset: ``ds[0:16, :, 10, 10]``, ``ds[..., r, c]``.

Only the selected scan positions are read, a batch of frames at a time (decoded on the fly for
ENCODED data), and only the selected detector pixels of each frame are kept: the whole
acquisition is never materialised unless the selection is the whole acquisition.
"""

from __future__ import annotations

import numpy as np

_AXES = ("scan row", "scan column", "detector row", "detector column")

#: Scan positions read per engine call.
BATCH_FRAMES = 1024


def _normalise(key, ndim: int = 4) -> tuple:
    if not isinstance(key, tuple):
        key = (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if any(k is Ellipsis for k in key):
        i = next(j for j, k in enumerate(key) if k is Ellipsis)
        fill = ndim - (len(key) - 1)
        key = key[:i] + (slice(None),) * max(fill, 0) + key[i + 1 :]
    if len(key) > ndim:
        raise IndexError(
            f"too many indices for a Dataset: it is 4-dimensional (R_r, R_c, k_r, k_c), "
            f"but {len(key)} were indexed"
        )
    return key + (slice(None),) * (ndim - len(key))


def _axis(k, n: int, axis: int) -> tuple[slice, bool]:
    """``(slice, is_integer)`` of one index ``k`` into an axis of ``n``."""
    if isinstance(k, (bool, np.bool_)):
        raise TypeError(f"{_AXES[axis]} index: a bool is not an index (found {k!r})")
    if isinstance(k, (int, np.integer)):
        i = int(k)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(
                f"{_AXES[axis]} index {i} is out of range for axis {axis} with size {n}"
            )
        return slice(j, j + 1), True
    if isinstance(k, slice):
        return k, False
    raise TypeError(
        f"{_AXES[axis]} index: only integers, slices and '...' index a Dataset "
        f"(found {type(k).__name__}); use ds.to_numpy() for other indexing"
    )


def getitem(ds, key) -> np.ndarray:
    """``ds[key]`` as a numpy array in the dataset's dtype (see the module docs)."""
    from quantem.gpu import detector

    shape = tuple(int(n) for n in ds.shape)
    parts = [_axis(k, n, a) for a, (k, n) in enumerate(zip(_normalise(key), shape))]
    (sr, _), (sc, _), (dr, _), (dc, _) = parts
    rows = range(shape[0])[sr]
    cols = range(shape[1])[sc]
    k_rows = range(shape[2])[dr]
    k_cols = range(shape[3])[dc]
    out = np.empty((len(rows), len(cols), len(k_rows), len(k_cols)), dtype=ds.dtype)
    positions = [(r, c) for r in rows for c in cols]
    flat = out.reshape(len(positions), len(k_rows), len(k_cols))
    for start in range(0, len(positions), BATCH_FRAMES):
        batch = positions[start : start + BATCH_FRAMES]
        frames = detector.frames(ds, batch)
        flat[start : start + len(batch)] = frames[:, dr, dc]
    return out[tuple(0 if is_int else slice(None) for _, is_int in parts)]
