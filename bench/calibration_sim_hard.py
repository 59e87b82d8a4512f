"""Run ``tests/tools/simulate_abtem.py`` with abTEM's default probe aperture made hard.

abTEM's default aperture (``Probe(soft=True)``) tapers the *amplitude* linearly over one
simulation pixel, ``A = clip((α − |θ|)/Δθ + 1/2, 0, 1)``, so the *intensity* ``A²`` falls to
50 % at ``α − 0.207 Δθ``, not at ``α``: a simulator artefact of 0.2 simulation pixels that a
physical (hard, then blurred) aperture edge does not have. This wrapper patches
``abtem.Probe`` to ``soft=False`` and otherwise runs the tool unchanged (same arguments).

Usage: python calibration_sim_hard.py PATH/TO/simulate_abtem.py [its arguments...]
"""

import functools
import runpy
import sys

import abtem

_init = abtem.Probe.__init__


@functools.wraps(_init)  # abTEM copies probes by reading __init__'s signature
def _hard(self, *args, **kwargs):
    kwargs["soft"] = False
    _init(self, *args, **kwargs)


abtem.Probe.__init__ = _hard
tool = sys.argv[1]
sys.argv = [tool] + sys.argv[2:]
runpy.run_path(tool, run_name="__main__")
