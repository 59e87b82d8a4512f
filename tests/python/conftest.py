"""Session fixtures (helpers and expected-value readers live in helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BAD_PIXELS, DET, SCAN, h5py_dectris, mask_array, write_acquisition


@pytest.fixture(scope="session")
def acquisition(tmp_path_factory):
    """The main acquisition: 5x7 scan, 11x13 u32 frames, 5 shards, bad pixels. Read-only."""
    tmp = tmp_path_factory.mktemp("dectris")
    master, files, data = write_acquisition(tmp, pixel_mask=mask_array())
    raw = h5py_dectris(master).reshape(SCAN + DET)
    assert np.array_equal(raw, data)  # the writer round-trips through h5py
    masked = raw.copy()
    for rc in BAD_PIXELS:
        masked[(..., *rc)] = 0
    return {"master": master, "files": files, "raw": raw, "masked": masked}
