"""``progress=`` of the long calls: a tqdm bar per stage, or the user's callable.

The engine runs with the GIL released on a worker thread; the calling thread wakes every few
tens of milliseconds and calls the callback with ``(stage, done, total)``. ``progress=True``
turns those calls into ``tqdm.auto`` bars (a widget in Jupyter, a text bar with rate and ETA on a
terminal), one per stage: loads report frames, detector passes frames, an SSB fit objective
evaluations.
"""

from __future__ import annotations

from typing import IO, Any, Callable

from quantem.gpu import _args

ProgressCallback = Callable[[str, int, int], Any]

#: The unit of each stage that does not count frames.
_UNITS = {"ssb fit": "eval", "save": "frame"}


class TqdmProgress:
    """A ``progress(stage, done, total)`` callable that draws one tqdm bar per stage.

    Parameters
    ----------
    file : text stream, optional
        Where the bars are written (default: tqdm's, standard error); with a stream the plain
        text bar is used (tests, logs), else ``tqdm.auto`` picks the notebook widget.
    **tqdm_kwargs
        Passed to ``tqdm`` (e.g. ``mininterval=0``, ``leave=False``).
    """

    def __init__(self, file: IO[str] | None = None, **tqdm_kwargs: Any):
        try:
            if file is None:
                from tqdm.auto import tqdm
            else:
                from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency of the package
            raise ImportError(
                "progress=True draws a tqdm bar; install it with `pip install tqdm` "
                "(or pass progress=callable(stage, done, total))"
            ) from None
        self._tqdm = tqdm
        self._file = file
        self._kwargs = tqdm_kwargs
        self._bar = None
        self._stage: str | None = None

    def _open(self, stage: str, total: int) -> None:
        kwargs: dict[str, Any] = {"dynamic_ncols": True, **self._kwargs}
        if self._file is not None:
            kwargs["file"] = self._file
        self._bar = self._tqdm(
            total=total or None,
            desc=stage,
            unit=_UNITS.get(stage, "frame"),
            unit_scale=True,
            **kwargs,
        )
        self._stage = stage

    def __call__(self, stage: str, done: int, total: int) -> None:
        bar = self._bar
        if bar is None or stage != self._stage or done < bar.n:
            self.close()
            self._open(stage, total)
            bar = self._bar
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)
        if total and done >= total:
            self.close()

    def close(self) -> None:
        """Close the running bar (a stage that ended early keeps its last count)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._stage = None


def callback(op: str, progress) -> ProgressCallback | None:
    """The native callback for ``progress=`` of operation ``op``: None, a tqdm bar or the user's
    callable (an exception it raises stops the call and propagates)."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return TqdmProgress()
    if callable(progress):
        return progress
    raise _args.wrong_type(
        op,
        "progress must be None, a bool or a callable",
        "None, True, False or progress(stage, done, total)",
        progress,
    )


def run(
    op: str,
    progress,
    call: Callable[[ProgressCallback | None], Any],
    final: Callable[[Any], tuple[str, int]] | None = None,
) -> Any:
    """``call(native_callback)``, closing a bar that a failed or interrupted call left open.

    ``final(result) -> (stage, done)``: for a stage whose total the engine can only estimate
    (an SSB fit's evaluations), one last ``progress(stage, done, done)`` once the call
    succeeded, so that the bar ends at the count that was done.
    """
    cb = callback(op, progress)
    try:
        out = call(cb)
        if cb is not None and final is not None:
            stage, done = final(out)
            cb(stage, int(done), int(done))
        return out
    finally:
        if isinstance(cb, TqdmProgress):
            cb.close()
