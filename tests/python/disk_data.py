"""A small acquisition with a bright disk (numpy only, independent of the engine): the BF
disk moves a little from frame to frame, so CoM, DPC and SSB all have something to find."""

from __future__ import annotations

import numpy as np


def disk_data(scan=(8, 9), det=24, radius=6.0, seed=0, dtype=np.uint16) -> np.ndarray:
    """uint16 counts ``scan + (det, det)``: a disk of 200 counts on 2, Poisson noise."""
    yy, xx = np.mgrid[:det, :det]
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(scan[0] * scan[1]):
        dr, dc = rng.normal(0.0, 0.3, 2)
        disk = ((yy - 11.5 - dr) ** 2 + (xx - 12.2 - dc) ** 2 <= radius**2).astype(float)
        frames.append(rng.poisson(200.0 * disk + 2.0))
    return np.array(frames, dtype=dtype).reshape(tuple(scan) + (det, det))
