"""Enumerations shared by the Python modules and the native extension."""

import enum


class DataRepresentation(enum.Enum):
    """How a dataset holds its counts.

    DENSE is a plain uint8/16/32 array; ENCODED is entropy-coded (rANS) counts decoded on the fly.
    """

    DENSE = "dense"
    ENCODED = "encoded"
