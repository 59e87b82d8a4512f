"""Run ``tests/tools/simulate_abtem.py`` with one of two physics variants, the tool unchanged.

* ``--hard-aperture``: abTEM's default probe aperture (``Probe(soft=True)``) tapers the
  *amplitude* linearly over one simulation pixel, ``A = clip((α − |θ|)/Δθ + 1/2, 0, 1)``, so the
  *intensity* ``A²`` falls to 50 % at ``α − 0.207 Δθ``, not at ``α``: a simulator artefact of
  0.2 simulation pixels that a physical (hard, then blurred) aperture edge does not have. This
  patches ``abtem.Probe`` to ``soft=False``.
* ``--potential-scale S``: multiplies the built potential by ``S`` (a weakly scattering
  specimen of the same geometry: with ``S = 0.1`` the kinematic, single-scattering regime),
  to separate geometric from dynamical effects on the focal reference.

Usage: python simulate_abtem_variant.py [--hard-aperture] [--potential-scale S]
       PATH/TO/simulate_abtem.py [its arguments...]
"""

import functools
import runpy
import sys

import abtem

args = sys.argv[1:]
if args and args[0] == "--hard-aperture":
    args = args[1:]
    _init = abtem.Probe.__init__

    @functools.wraps(_init)  # abTEM copies probes by reading __init__'s signature
    def _hard(self, *a, **k):
        k["soft"] = False
        _init(self, *a, **k)

    abtem.Probe.__init__ = _hard
if args and args[0] == "--potential-scale":
    scale = float(args[1])
    args = args[2:]
    _build = abtem.Potential.build
    _depth = [0]  # a lazy build calls build again while computing: scale the outer one only

    @functools.wraps(_build)
    def _scaled(self, *a, **k):
        outer = _depth[0] == 0
        _depth[0] += 1
        try:
            built = _build(self, *a, **k)
            if outer:
                built = built.compute()
                built._array = built._array * scale
        finally:
            _depth[0] -= 1
        return built

    abtem.Potential.build = _scaled
tool = args[0]
sys.argv = [tool] + args[1:]
runpy.run_path(tool, run_name="__main__")
