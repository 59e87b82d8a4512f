"""Single-sideband ptychography (SSB) with aberration fitting.

Definitions (``SCIENCE.md``, anchor §8): the bright-field (BF) pixels ``b`` are the detector
pixels inside the BF disk fitted from the mean diffraction pattern; each has a probe-space
vector ``k_b = R(θ) ((i_b − c_r) Δk, (j_b − c_c) Δk)`` with ``Δk = Δθ·10⁻³/λ`` and the detector
sampling ``Δθ = α / r_BF`` (mrad per pixel) unless given (the anchor's ``2α / r`` only with
``compat_2alpha=True``). ``G_b(ν)`` is the unnormalised 2-D FFT over the scan of pixel ``b``'s
image; the double-overlap ("trotter") correction
``Γ_b(ν) = P(k_b − ν) P*(k_b) − P(k_b) P*(k_b + ν)`` (derived for a weak phase object; the same as
SCIENCE.md's ``P(ν − k_b)…`` form for C10/C12/C30, and Hermitian like ``G`` for C21/C23) with the
probe ``P = A·exp(−iχ)`` and the full Krivanek aberration function
``χ = (2π/λ) Σ C_nm α^(n+1)/(n+1) cos(m(φ − φ_nm))`` is removed phase-only, and the object is the
mean of the corrected per-pixel terms.

Engines: a dataset held by the CPU engine is prepared there (``G`` as complex float64). A dataset
on CUDA stays on the card: the BF images are gathered there (ENCODED data decoded on the fly),
``G`` is kept as half spectra in complex float32 (or float16 when float32 does not fit
``memory_budget``), and objects and losses are computed on the GPU (float32, sums in float64;
objects within ~2e-7 relative L2 of the CPU's float64 with float32 ``G``, ~2e-5 with float16).

Aberrations are in ångström and their angles in radians, named ``C10`` (defocus; positive =
overfocus, abTEM's ``defocus`` is ``−C10``), ``C12``/``phi12`` (two-fold astigmatism),
``C21``/``phi21`` (coma), ``C23``/``phi23`` (three-fold astigmatism) and ``C30`` (spherical).

The scan may have any shape (rectangular, not a power of two): nothing is cropped or padded.

>>> from quantem.gpu import io, ssb
>>> ds = io.load("scan_master.h5")
>>> s = ssb.SSB(ds, voltage_kv=300, semiangle_mrad=25, scan_step_a=0.4)
>>> r = s.reconstruct({"C10": 50.0, "C12": 20.0, "phi12": 0.5})
>>> f = s.fit(seed=0)                    # C10, C12, phi12 by default
>>> f.aberrations["C10"], f.loss, f.evaluations
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quantem.gpu import _args, _native, _progress, results
from quantem.gpu.detector import _invalid

__all__ = [
    "ABERRATIONS",
    "DEFAULT_FIT",
    "OBJECTIVES",
    "SSB",
    "SSBFit",
    "SSBResult",
    "UNITS",
]

#: Every aberration coefficient :meth:`SSB.reconstruct` accepts, in order.
ABERRATIONS = ("C10", "C12", "phi12", "C21", "phi21", "C23", "phi23", "C30")

#: The unit of each coefficient.
UNITS = {name: ("rad" if name.startswith("phi") else "Å") for name in ABERRATIONS}

#: What :meth:`SSB.fit` fits when ``fit`` is not given.
DEFAULT_FIT = ("C10", "C12", "phi12")

#: The objectives :meth:`SSB.fit` and :meth:`SSB.objective` know, the default first.
#:
#: ``"coherence"`` is the default: on abTEM multislice data at a realistic dose (6k e⁻/frame) only
#: it recovers C10 within 2 % and C12 within 1 % on one unit cell, and on a GPU it costs a
#: fraction of the phase variance. ``"phase_variance"``: the anchor's mean over scan positions of
#: the variance over BF pixels of the per-pixel phases (lower is better). ``"coherence"``: the
#: share of the data's power the weak-phase model ``G_b(ν) = iΦ(ν) Γ_b(ν)`` explains, negated:
#: ``−Σ_{ν≠0} [|Σ_b G_b Γ_b*|² / Σ_b |Γ_b|²] / Σ_{ν≠0} Σ_b |G_b|²`` in ``[−1, 0]``. Each
#: frequency's term is largest exactly where ``Γ ∝ G`` over the pixels; the loss is smooth in the
#: aberrations (the fit's last stage models it), never takes a phase, so strong phases that wrap
#: past ±π do not scramble it, and each frequency weighs by its own signal
#: (docs/science.md §9).
OBJECTIVES = ("coherence", "phase_variance")

_OP = "ssb"


def _shape(a: np.ndarray) -> str:
    return "(" + ", ".join(str(n) for n in a.shape) + ")"


def _number(name: str, value, *, positive: bool = True, **bounds) -> float:
    """``value`` as a finite float (``> 0`` when ``positive``), else an error naming ``name``:
    ``ArgumentTypeError`` for a non-number (a string or bool is not read as one),
    ``InvalidArgumentError`` for NaN, inf or a value out of range."""
    return _args.number(_OP, name, value, positive=positive, **bounds)


def _required(name: str, value, unit: str) -> float:
    if value is None:
        raise _invalid(
            _OP,
            f"{name} is required (the engine never guesses a calibration)",
            expected=f"{name}=<value in {unit}>, or ds.calibration.{name}",
            found="None",
        )
    return _number(name, value)


def _pair(name: str, value) -> tuple[float, float]:
    """A scalar or a ``(row, col)`` pair of positive numbers."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        v = _number(name, value)
        return (v, v)
    items = _args._items(_OP, name, value, 2, "a number or (row, col)")
    return (_number(f"{name}[0]", items[0]), _number(f"{name}[1]", items[1]))


def _scan_step(value) -> tuple[float, float]:
    """``scan_step_a`` as a ``(row, col)`` pair; required, like the other calibrations."""
    if value is None:
        raise _invalid(
            _OP,
            "scan_step_a is required (the engine never guesses a calibration)",
            expected="scan_step_a=<Å> or (row Å, col Å), or ds.calibration.scan_step_a",
            found="None",
        )
    return _pair("scan_step_a", value)


def _aberrations(values: Mapping[str, float] | None, what: str = "aberrations") -> dict[str, float]:
    """A checked ``{name: value}`` dict (every name known, values finite)."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise _invalid(
            _OP,
            f"{what} is a mapping of coefficient names to values",
            expected='e.g. {"C10": 50.0, "C12": 20.0, "phi12": 0.5}',
            found=type(values).__name__,
        )
    out = {}
    for k, v in values.items():
        if not isinstance(k, str) or k not in ABERRATIONS:
            raise _invalid(
                _OP,
                f"unknown aberration coefficient in {what}",
                expected=", ".join(ABERRATIONS),
                found=repr(k),
            )
        out[k] = _number(f"{what}[{k!r}]", v, positive=False)
    return out


@dataclass(frozen=True, repr=False)
class SSBResult:
    """What :meth:`SSB.reconstruct` returns.

    Attributes
    ----------
    object : numpy.ndarray
        ``complex128`` ``(R_r, R_c)``: the reconstructed object (count-scaled, not normalised).
    phase : numpy.ndarray
        ``float64`` ``(R_r, R_c)``: ``arg(object)``, radians in ``(−π, π]``.
    amplitude : numpy.ndarray
        ``float64`` ``(R_r, R_c)``: ``|object|``.
    weak_phase : numpy.ndarray
        ``float64`` ``(R_r, R_c)``: the first-order phase ``Im(object) / mean(Re(object))``,
        radians. The corrected object is ``d + iψ`` (``Re`` constant up to the Nyquist lines of
        an even scan side), so ``phase = atan(ψ/d)`` compresses strong features; ``ψ/d`` is the
        linear weak-phase estimate (it correlates better with the true projected phase on
        simulated SrTiO3).
    aberrations : dict
        The aberrations the probe was corrected with, every coefficient (Å, rad).
    provenance : dict
    """

    object: np.ndarray
    phase: np.ndarray
    amplitude: np.ndarray
    weak_phase: np.ndarray
    aberrations: dict[str, float]
    provenance: dict[str, Any] = field(default_factory=dict)
    #: Scan axes ``(R_r, R_c)`` in Å (from ``scan_step_a``).
    axes: tuple[results.Axis, ...] = ()
    #: Unit of each array: phases in ``"rad"``, ``amplitude`` and ``object`` in ``"a.u."``.
    units: dict[str, str] = field(default_factory=dict)

    def save(self, path, which: str | None = None) -> str:
        """Write the arrays as EMD/HDF5 (``.h5``, ``.emd``) or one image as TIFF (``.tif``;
        default the phase); see :func:`quantem.gpu.results.save`. Returns the path."""
        return results.save(self, path, which)

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> SSBResult:
        obj = np.asarray(d["object_re"], dtype=np.float64) + 1j * np.asarray(
            d["object_im"], dtype=np.float64
        )
        return cls(
            object=obj,
            phase=d["phase"],
            amplitude=d["amplitude"],
            weak_phase=d["weak_phase"],
            aberrations=dict(d["aberrations"]),
            provenance=d["provenance"],
        )

    def __array__(self, dtype=None, copy=None):
        # np.asarray(result) is the phase, the image users look at.
        return np.asarray(self.phase, dtype=dtype)

    def __repr__(self) -> str:
        ab = ", ".join(f"{k}={v:.4g}" for k, v in self.aberrations.items() if v != 0.0)
        return f"SSBResult(phase={_shape(self.phase)}, aberrations={{{ab}}})"


@dataclass(frozen=True, repr=False)
class SSBFit:
    """What :meth:`SSB.fit` returns.

    Attributes
    ----------
    aberrations : dict
        Every coefficient after the fit (those not fitted keep their start value): Å, rad.
    fitted : tuple of str
        The coefficients that were fitted.
    units : dict
        The unit of each coefficient.
    loss : float
        The objective at ``aberrations`` (lower is better).
    evaluations : int
        Objective evaluations, global search and local refinement together.
    loss_curve : numpy.ndarray
        ``float64``: the loss of every evaluation in order (global points first, then
        Nelder–Mead); ``np.minimum.accumulate`` gives the best so far.
    objective : str
        The objective minimised.
    result : SSBResult
        The reconstruction at the fitted aberrations.
    provenance : dict
        The fit's record: search ranges, seed, budgets, method.
    """

    aberrations: dict[str, float]
    fitted: tuple[str, ...]
    units: dict[str, str]
    loss: float
    evaluations: int
    loss_curve: np.ndarray
    objective: str
    result: SSBResult
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def axes(self) -> tuple[results.Axis, ...]:
        """Scan axes of :attr:`result` (Å)."""
        return self.result.axes

    def save(self, path, which: str | None = None) -> str:
        """Write :attr:`result`'s arrays, the loss curve and the fitted values as EMD/HDF5
        (``.h5``, ``.emd``) or the phase as TIFF (``.tif``); see
        :func:`quantem.gpu.results.save`. Returns the path."""
        return results.save(self, path, which)

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> SSBFit:
        fitted = tuple(str(n) for n in d["fitted"])
        return cls(
            aberrations=dict(d["aberrations"]),
            fitted=fitted,
            units={k: UNITS[k] for k in ABERRATIONS},
            loss=float(d["loss"]),
            evaluations=int(d["evaluations"]),
            loss_curve=np.asarray(d["loss_curve"], dtype=np.float64),
            objective=str(d["objective"]),
            result=SSBResult._from_native(d["result"]),
            provenance=d["provenance"],
        )

    def __repr__(self) -> str:
        ab = ", ".join(f"{k}={self.aberrations[k]:.4g} {UNITS[k]}" for k in self.fitted)
        return (
            f"SSBFit({ab}; loss={self.loss:.6g}, evaluations={self.evaluations}, "
            f"objective={self.objective!r})"
        )


class SSB:
    """An acquisition prepared for SSB: BF pixels, their probe vectors and scan spectra ``G``.

    Preparing reads the BF pixels' images once and keeps ``G`` for every BF pixel (about
    ``B · R_r · (R_c/2 + 1) · 16`` bytes); :meth:`reconstruct`, :meth:`objective` and :meth:`fit`
    then never touch the dataset again.

    Parameters
    ----------
    ds : Dataset
        Any representation, any backend (a CUDA dataset's BF pixels are copied to the host).
    voltage_kv : float
        Accelerating voltage, kV. Each calibration left out (``None``) comes from
        ``ds.calibration`` (:mod:`quantem.gpu.calibration`: the user's value, else the file's);
        voltage, semi-angle and scan step must be known one way or the other.
    semiangle_mrad : float
        Probe-forming aperture semi-angle α, mrad.
    scan_step_a : float or (float, float)
        Scan step along rows and columns, Å.
    det_sampling_mrad : float, optional
        Detector angular sampling, mrad per pixel; default ``α / r_BF`` with the fitted BF-disk
        radius (the disk edge is the aperture edge).
    rotation_deg : float, optional
        Scan–detector rotation, degrees, with the convention of :func:`quantem.gpu.dpc.run`
        (pass its ``rotation_deg``); ``ds.calibration.rotation_deg`` when left out, else 0.
    transpose : bool
        Exchange the detector's row and column axes before the rotation, as
        :func:`quantem.gpu.dpc.run` does when it reports ``transpose=True`` (pass it on with the
        rotation: ``SSB(ds, rotation_deg=d.rotation_deg, transpose=d.transpose)``).
    compat_2alpha : bool
        Use the anchor's ``Δθ = 2α / r_BF`` when ``det_sampling_mrad`` is not given
        (reproduces the anchor's numbers; not physical).
    bf_threshold : float
        Keep only BF pixels whose mean intensity exceeds this fraction of the maximum.
    memory_budget : int, optional
        Bytes ``G`` may take; a larger ``G`` raises :class:`~quantem.gpu.MemoryBudgetError`.
        On CUDA: the device bytes SSB may allocate besides the dataset (``None`` = the free
        device memory).
    g_storage : {None, "f32", "f16", "f12"}
        CUDA only: how ``G`` is kept on the card (half spectra). ``None`` takes complex f32
        when it fits the budget, else complex f16 scaled per pixel (half the bytes; object
        within ~2e-5 relative L2 of the CPU's f64), else f12: that f16 rounded to 7
        significant bits, 3 bytes a value (what fits 8,653 BF pixels of a 512² scan beside the
        data on a 6 GiB card; its object is within ~2e-3 relative L2 of f32's). The CPU engine
        always keeps complex f64.
    engine : {"auto", "cpu", "cuda"}
        Where SSB runs: ``"auto"`` = the engine holding ``ds``; ``"cuda"`` also takes a
        dataset loaded with ``backend="cpu"`` (its BF pixels are gathered on the host and
        uploaded in batches, so the card holds ``G`` but never the acquisition: SSB on a card
        too small for both); ``"cpu"`` needs ``ds`` on the host.
    progress : None, True or callable
        Progress of preparing (gathering the BF pixels' images): ``True`` draws a tqdm bar
        (``tqdm.auto``); a callable gets ``(stage, done, total)`` on the calling thread.
    """

    def __init__(
        self,
        ds,
        voltage_kv: float | None = None,
        semiangle_mrad: float | None = None,
        scan_step_a: float | Sequence[float] | None = None,
        det_sampling_mrad: float | None = None,
        rotation_deg: float | None = None,
        *,
        transpose: bool = False,
        compat_2alpha: bool = False,
        bf_threshold: float = 0.0,
        memory_budget: int | None = None,
        g_storage: str | None = None,
        engine: str = "auto",
        progress=None,
    ):
        _args.dataset(_OP, ds)
        # What the call leaves out comes from ds.calibration (the user's values, else the
        # file's); an argument given here still wins.
        known = ds.calibration.ssb_arguments()
        voltage_kv = known.get("voltage_kv") if voltage_kv is None else voltage_kv
        semiangle_mrad = known.get("semiangle_mrad") if semiangle_mrad is None else semiangle_mrad
        scan_step_a = known.get("scan_step_a") if scan_step_a is None else scan_step_a
        if det_sampling_mrad is None:
            det_sampling_mrad = known.get("det_sampling_mrad")
        rotation_deg = known.get("rotation_deg", 0.0) if rotation_deg is None else rotation_deg
        # Each argument is checked as it goes into the native call's keywords (a dict keeps
        # the order, so the first bad argument is the one reported).
        native_args = dict(
            voltage_kv=_required("voltage_kv", voltage_kv, "kV"),
            semiangle_mrad=_required("semiangle_mrad", semiangle_mrad, "mrad"),
            scan_step_a=_scan_step(scan_step_a),
            det_sampling_mrad=(
                None
                if det_sampling_mrad is None
                else _number("det_sampling_mrad", det_sampling_mrad)
            ),
            rotation_deg=_number("rotation_deg", rotation_deg, positive=False),
            bf_threshold=_number(
                "bf_threshold", bf_threshold, positive=False, minimum=0.0, below=1.0
            ),
            memory_budget=_args.optional_integer(
                _OP, "memory_budget", memory_budget, minimum=0, maximum=_args.U64_MAX
            ),
            g_storage=(
                None
                if g_storage is None
                else _args.text(_OP, "g_storage", g_storage, ("f32", "f16", "f12"))
            ),
            engine=_args.text(_OP, "engine", engine, ("auto", "cpu", "cuda")),
            compat_2alpha=_args.flag(_OP, "compat_2alpha", compat_2alpha),
            transpose=_args.flag(_OP, "transpose", transpose),
        )
        self._axes = results.scan_axes(tuple(ds.shape)[:2], native_args["scan_step_a"])
        self._native = _progress.run(
            _OP,
            progress,
            lambda cb: _native.ssb_prepare(ds, **native_args, progress=cb),
        )

    @property
    def info(self) -> dict[str, Any]:
        """The prepared geometry: BF pixel count, disk, detector sampling, wavelength, ..."""
        return self._native.info()

    @property
    def objectives(self) -> tuple[str, ...]:
        """Names of the objectives the engine knows (the first is the default)."""
        return tuple(self._native.objectives())

    def _objective(self, objective: str) -> str:
        return _args.text(_OP, "objective", objective, self.objectives)

    def reconstruct(self, aberrations: Mapping[str, float] | None = None) -> SSBResult:
        """The object with the probe corrected for ``aberrations``.

        Parameters
        ----------
        aberrations : dict, optional
            ``{"C10": Å, "C12": Å, "phi12": rad, ...}``; missing coefficients are 0.

        Returns
        -------
        SSBResult
        """
        return self._with_axes(
            SSBResult._from_native(self._native.reconstruct(_aberrations(aberrations)))
        )

    _UNITS = {"phase": "rad", "weak_phase": "rad", "amplitude": "a.u.", "object": "a.u."}

    def _with_axes(self, r: SSBResult) -> SSBResult:
        return results.with_axes(r, self._axes, self._UNITS)

    def objective(
        self, aberrations: Mapping[str, float] | None = None, objective: str = "coherence"
    ) -> float:
        """The fit's loss at ``aberrations`` (lower is better)."""
        return float(self._native.objective(_aberrations(aberrations), self._objective(objective)))

    def fit(
        self,
        seed: int = 0,
        fit: Sequence[str] = DEFAULT_FIT,
        ranges: Mapping[str, tuple[float, float]] | None = None,
        objective: str = "coherence",
        global_evals: int | None = None,
        local_max_iter: int | None = None,
        start: Mapping[str, float] | None = None,
        local_starts: int | None = None,
        thickness_a: float | None = None,
        fitted_plane: str = "exit",
        progress=None,
        coarse: bool = True,
    ) -> SSBFit:
        """Fit aberrations: a seeded global search, then Nelder–Mead refinement.

        Deterministic for a given seed (and backend).

        Parameters
        ----------
        seed : int
            Seed of the global search.
        fit : sequence of str
            The coefficients to fit (any of :data:`ABERRATIONS`); the others keep ``start``.
        ranges : dict, optional
            ``{name: (low, high)}`` search ranges in Å / rad; the engine's documented defaults
            for names not given (recorded in ``SSBFit.provenance``).
        objective : str
            One of :attr:`objectives`.
        global_evals, local_max_iter : int, optional
            Budgets of the global search (points besides the start point) and of each local
            stage (Nelder–Mead iterations, or designs of the coherence fit's last stage); the
            engine's defaults when omitted
            (``SSB.info["fit_defaults"]``: 200 and 200).
        start : dict, optional
            Start (and fixed) values of the coefficients; 0 when omitted. The start point is
            the global search's first point.
        local_starts : int, optional
            Nelder–Mead runs, from the best distinct global candidates (default 3). Each
            runs until its simplex spans 1 % of the box; only the best of them goes on to
            the last stage (the others stop there): Newton steps on quadratic models of the
            full loss for ``"coherence"`` (at most ``local_max_iter`` designs, and never more
            than 12), its simplex continued to 1e-4 for ``"phase_variance"``.
        thickness_a : float, optional
            Specimen thickness, Å. When given, ``provenance["focal_reference"]`` holds C10
            referred to the entrance surface (``C10_entrance_a``, the plane a simulator such as
            abTEM defines its defocus at) besides the fitted value; ``aberrations`` is unchanged.
        fitted_plane : {"exit", "mid"}
            Which plane the fitted C10 is taken to refer to (docs/calibration.md): ``"exit"``
            (``C10_entrance = C10 − t``; strongly scattering crystals: measured 0.57–0.79 t
            on SrTiO3, 3–5 cells at 200 and 300 kV, so it overstates the depth by 0.2–0.4 t)
            or ``"mid"`` (``C10 − t/2``; weakly scattering, kinematic specimens).
        progress : None, True or callable
            ``True`` draws a tqdm bar of objective evaluations (``tqdm.auto``); a callable gets
            ``(stage, done, total)`` on the calling thread (``total`` is an estimate while the
            fit runs; a last call ``("ssb fit", evaluations, evaluations)`` ends it).
        coarse : bool
            ``True`` (default): the global points and each start's first stage use the coarse
            loss over about a quarter of the BF pixels (whole detector rows, every fourth),
            the starts are then compared on the full loss and the best refined on it from a
            fresh simplex. Roughly 2.5× fewer pixel terms for the same minimum;
            ``provenance["params"]["fit"]`` says how many evaluations were coarse. Without
            effect when the disk is too small (the sample would hold fewer than 256 pixels).
            ``False``: every loss over every pixel.

        Notes
        -----
        The global search is a scrambled Halton sequence with a seeded shift over the box of
        ``ranges`` (defaults: C10 ±400 Å, C12 0…100 Å, phi12 ±π/2, C21 and C23 0…1000 Å,
        phi21 ±π, phi23 ±π/3, C30 ±5·10⁴ Å); its points do not depend on earlier losses, so
        they are evaluated in parallel without changing the result.

        Returns
        -------
        SSBFit
        """
        if isinstance(fit, str):
            fit = (fit,)
        if isinstance(fit, (bytes, Mapping)) or not isinstance(fit, Sequence):
            raise _args.wrong_type(_OP, "fit must be coefficient names", '("C10", "C12")', fit)
        names = list(fit)
        for n in names:
            if not isinstance(n, str) or n not in ABERRATIONS:
                raise _invalid(
                    _OP,
                    "unknown coefficient to fit",
                    expected=", ".join(ABERRATIONS),
                    found=repr(n),
                )
        if not names or len(set(names)) != len(names):
            raise _invalid(
                _OP,
                "fit names each coefficient once",
                expected="at least one distinct name",
                found=repr(tuple(names)),
            )
        rng = None
        if ranges is not None:
            if not isinstance(ranges, Mapping):
                raise _invalid(
                    _OP,
                    "ranges is a mapping of names to (low, high)",
                    expected='e.g. {"C10": (-400.0, 400.0)}',
                    found=type(ranges).__name__,
                )
            rng = {}
            for k, lohi in ranges.items():
                if k not in ABERRATIONS:
                    raise _invalid(
                        _OP,
                        "unknown coefficient in ranges",
                        expected=", ".join(ABERRATIONS),
                        found=repr(k),
                    )
                lo, hi = _args._items(_OP, f"ranges[{k!r}]", lohi, 2, "(low, high)")
                lo = _number(f"ranges[{k!r}][0]", lo, positive=False)
                hi = _number(f"ranges[{k!r}][1]", hi, positive=False)
                if not lo < hi:
                    raise _invalid(
                        _OP,
                        f"ranges[{k!r}] must be finite with low < high",
                        expected="low < high",
                        found=repr(lohi),
                    )
                rng[k] = (lo, hi)
        plane = _args.text(_OP, "fitted_plane", fitted_plane, ("exit", "mid"))
        if thickness_a is not None:
            t = _number("thickness_a", thickness_a, positive=False, minimum=0.0)
        kwargs = dict(
            seed=_args.integer(_OP, "seed", seed, minimum=0, maximum=_args.U64_MAX),
            fit=names,
            ranges=rng,
            objective=self._objective(objective),
            global_evals=_args.optional_integer(_OP, "global_evals", global_evals, minimum=0),
            local_max_iter=_args.optional_integer(_OP, "local_max_iter", local_max_iter, minimum=0),
            local_starts=_args.optional_integer(_OP, "local_starts", local_starts, minimum=1),
            start=_aberrations(start, "start"),
            coarse=_args.flag(_OP, "coarse", coarse),
        )
        d = _progress.run(
            _OP,
            progress,
            lambda cb: self._native.fit(**kwargs, progress=cb),
            final=lambda d: ("ssb fit", d["evaluations"]),
        )
        f = SSBFit._from_native(d)
        f = dataclasses.replace(f, result=self._with_axes(f.result))
        if thickness_a is None:
            return f
        depth = t if plane == "exit" else t / 2
        c10 = f.aberrations["C10"]
        focal = {
            "thickness_a": t,
            "fitted_plane": plane,
            "C10_fitted_a": c10,
            "C10_entrance_a": c10 - depth,
            "rule": f"C10_entrance = C10_fitted - {'t' if plane == 'exit' else 't/2'} "
            "(C10 grows by z at depth z; docs/calibration.md)",
        }
        return dataclasses.replace(f, provenance={**f.provenance, "focal_reference": focal})

    def __repr__(self) -> str:
        i = self.info
        return (
            f"SSB(scan={tuple(i.get('scan_shape', ()))}, bf_pixels={i.get('n_bf')}, "
            f"det_sampling_mrad={i.get('det_sampling_mrad', float('nan')):.4g})"
        )
