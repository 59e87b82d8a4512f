"""Which compute backends exist here and which one a request resolves to."""

from __future__ import annotations

from quantem.gpu import _args, _native

__all__ = ["available", "info", "resolve"]


def available() -> list[str]:
    """Names of the backends usable here, most preferred first.

    Returns
    -------
    list of str
        For example ``["cpu"]`` or ``["cuda", "cpu"]``.
    """
    names = [b["name"] for b in _native.backends() if b["available"]]
    # CUDA is the preferred engine wherever it can run.
    return sorted(names, key=lambda name: name != "cuda")


def resolve(name: str = "auto") -> str:
    """The backend a request resolves to.

    Parameters
    ----------
    name : {"auto", "cpu", "cuda", "mps"}
        ``"auto"`` picks CUDA when usable, else the CPU.

    Returns
    -------
    str
        The backend that would run, e.g. ``"cpu"``.

    Raises
    ------
    BackendUnavailableError
        An explicit backend that cannot run here (the message says why); never a silent CPU run.
    InvalidArgumentError
        An unknown name.
    """
    return _native.resolve_backend(_args.text("device.resolve", "name", name))


def info() -> list[dict[str, str | bool]]:
    """Every backend this build knows, with its availability.

    Returns
    -------
    list of dict
        ``{"name": str, "available": bool, "detail": str}``; ``detail`` describes the device,
        or says why the backend is unavailable.
    """
    return list(_native.backends())
