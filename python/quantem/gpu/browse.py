"""The browse service: a local web page onto resident acquisitions (``docs/browse.md``).

:func:`serve` starts the service in this process, on threads of its own, and returns a
:class:`BrowseServer` handle; Python keeps running while it serves. The page and its HTTP API
(``/api/v1``) show diffraction patterns, frames, virtual images, CoM/DPC and SSB of one
acquisition, of every acquisition in a folder, or of a dataset already loaded here.

>>> from quantem.gpu import io, browse
>>> ds = io.load("scan_master.h5")
>>> srv = browse.serve(ds)            # shares ds: the service reads it, never copies it
>>> srv.url                           # open it in a browser (the token is part of the URL)
'http://127.0.0.1:50123/?token=3f9c...'
>>> srv                               # in Jupyter: the page in an IFrame
>>> srv.stop()                        # or: with browse.serve("/data/session-3/") as srv: ...

Security follows Jupyter's model: the service binds ``127.0.0.1`` by default and every route
checks a random token that is part of :attr:`BrowseServer.url`. Binding another address with the
token disabled (``token=False``) is refused.
"""

from __future__ import annotations

import html
import os
import pathlib
import re
import time
from typing import Any, Union

from quantem.gpu import _args, _native
from quantem.gpu._enums import DataRepresentation

__all__ = ["BrowseServer", "serve"]

_OP = "browse.serve"

_BACKENDS = ("auto", "cpu", "cuda", "mps")

#: A fixed token is put into the URL as it is, so it is limited to URL-safe characters.
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~-]{1,256}")

Source = Union[str, "os.PathLike[str]", "_native.Dataset"]


class BrowseServer:
    """A running browse service (made by :func:`serve`).

    Attributes
    ----------
    url : str
        The page's address, with ``?token=`` when a token is required.
    token : str or None
        The token every request must carry (``None`` when disabled).
    host : str
        The address the service is bound to.
    port : int
        The port it listens on (the one picked by the system when ``port=0`` was asked).

    The service runs until :meth:`stop`, the end of a ``with`` block, or until this object is
    garbage-collected (keep a reference while you use the page).
    """

    __slots__ = ("_native",)

    def __init__(self, native: Any):
        self._native = native

    @property
    def url(self) -> str:
        """The page's address, with the token."""
        return self._native.url

    @property
    def token(self) -> str | None:
        """The token requests must carry, or ``None`` when the token check is disabled."""
        return self._native.token

    @property
    def host(self) -> str:
        """The address the service is bound to (e.g. ``"127.0.0.1"``)."""
        return self._native.host

    @property
    def port(self) -> int:
        """The port the service listens on."""
        return self._native.port

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._native.stopped

    def stop(self) -> None:
        """Stop serving and free the port; calling it again does nothing.

        Requests in flight are answered first (the GIL is released meanwhile); idle
        connections are closed. A shared dataset stays open (close it with ``ds.close()``).
        """
        self._native.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the service is stopped (by :meth:`stop` from another thread), for at most
        ``timeout`` seconds (``None``: no limit). For scripts: ``browse.serve(...).wait()``
        serves until Ctrl-C, which stops the service and raises ``KeyboardInterrupt``.

        Returns
        -------
        bool
            True when the service has stopped, False when ``timeout`` passed first.
        """
        limit = _args.optional_number("BrowseServer.wait", "timeout", timeout, minimum=0.0)
        deadline = None if limit is None else time.monotonic() + limit
        try:
            while not self.stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                # Short sleeps keep Ctrl-C prompt.
                time.sleep(0.1 if left is None else min(0.1, left))
        except KeyboardInterrupt:
            self.stop()
            raise
        return True

    def __enter__(self) -> BrowseServer:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.stop()
        return False

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else self.url
        return f"BrowseServer({state})"

    def _repr_html_(self) -> str:
        """The page in an IFrame (Jupyter), with a link to open it in its own tab.

        The IFrame loads from the browser that shows the notebook, so it works when the
        notebook's browser runs on the machine that serves (a remote kernel needs the port
        forwarded, as for Jupyter itself).
        """
        if self.stopped:
            return "<p><code>BrowseServer</code>: stopped</p>"
        url = html.escape(self.url, quote=True)
        return (
            f'<div><iframe src="{url}" width="100%" height="720" '
            f'style="border: 1px solid #ccc" title="quantem.gpu browse"></iframe>'
            f'<p><a href="{url}" target="_blank" rel="noopener">open in a new tab</a></p></div>'
        )


def _source(value: Any) -> tuple[str, Any]:
    """``("dataset", ds)``, ``("demo", None)`` or ``("path", str)``."""
    if isinstance(value, _native.Dataset):
        if value.closed:
            raise _args.invalid(_OP, "the dataset has been closed", "an open dataset", "closed")
        return "dataset", value
    if isinstance(value, str) and value == "demo":
        return "demo", "demo"
    if isinstance(value, (str, bytes, os.PathLike)):
        return "path", _args.path(_OP, "source", value)
    raise _args.wrong_type(
        _OP,
        "source must be a Dataset, a path or 'demo'",
        "a Dataset from io.load, str/bytes/os.PathLike (a file or a folder), or 'demo'",
        value,
    )


def _token(value: Any) -> bool | str | None:
    """``None`` (a random token), ``False`` (no token) or the fixed token."""
    if value is None or value is False:
        return value
    if not isinstance(value, str):
        raise _args.wrong_type(
            _OP, "token must be None, False or a str", "None (random), False (none) or a str", value
        )
    if not _TOKEN_RE.fullmatch(value):
        raise _args.invalid(
            _OP,
            "token must be 1 to 256 URL-safe characters",
            "letters, digits, '.', '_', '~' or '-'",
            repr(value),
        )
    return value


def _representation(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, DataRepresentation):
        return value.value
    if isinstance(value, str):
        return _args.text(_OP, "representation", value, ("dense", "encoded"))
    raise _args.wrong_type(
        _OP,
        "representation must be a name or an io.DataRepresentation member",
        "'dense', 'encoded', an io.DataRepresentation member or None",
        value,
    )


def serve(
    source: Source,
    backend: str = "auto",
    host: str = "127.0.0.1",
    port: int = 0,
    token: None | bool | str = None,
    memory_budget: int | None = None,
    representation: None | str | DataRepresentation = None,
    open_browser: bool = False,
) -> BrowseServer:
    """Start the browse service and return its handle (the service runs on its own threads).

    Parameters
    ----------
    source : Dataset, str, bytes, os.PathLike or "demo"
        A dataset loaded with :func:`quantem.gpu.io.load` (shared, not copied: the service
        reads it while it is open and answers 410 ``closed`` after ``ds.close()``; it never
        releases it), a path to one acquisition (a file the loader reads), a folder (a catalog
        of every acquisition in it, rescanned on each listing, loaded on first use), or the
        string ``"demo"`` for the built-in simulated acquisition (a file named ``demo`` is
        served with ``"./demo"`` or ``pathlib.Path("demo")``).
    backend : {"auto", "cpu", "cuda", "mps"}
        Where a path's acquisitions are loaded and computed. ``"auto"`` picks CUDA when usable,
        else the CPU; an explicit backend that cannot run raises
        :class:`~quantem.gpu.BackendUnavailableError`. A dataset is served on its own backend:
        an explicit ``backend`` that differs from ``ds.backend`` is refused.
    host : str
        The address to bind. ``"127.0.0.1"`` (the default) serves this machine only.
    port : int
        The port, 0 to 65535; 0 lets the system pick a free one (see :attr:`BrowseServer.port`).
    token : None, False or str
        ``None``: a random 32-byte token (hex) made at start. A ``str``: that token (1 to 256
        URL-safe characters). ``False``: no token check, allowed only on a loopback ``host``.
    memory_budget : int, optional
        Bytes the loaded acquisitions of a path may occupy together; the least recently used
        are released first (default: 80 % of the GPU's memory on CUDA, half of the machine's
        memory on the CPU). Not for a dataset (it is already loaded).
    representation : {"dense", "encoded"}, DataRepresentation or None
        How a path's acquisitions are held (``None``: the backend's default, ENCODED on
        CUDA). Not for a dataset (it is already loaded).
    open_browser : bool
        Open the page in the default web browser once the service is up.

    Returns
    -------
    BrowseServer
        ``.url`` (with the token), ``.token``, ``.host``, ``.port``, ``.stop()``, ``.wait()``;
        a context manager; shown as the page in an IFrame by Jupyter.

    Raises
    ------
    InvalidArgumentError
        An out-of-range port, an unknown backend or representation, a closed dataset, a
        ``backend``/``representation``/``memory_budget`` that a dataset cannot take, a
        non-loopback ``host`` with ``token=False``.
    ArgumentTypeError
        An argument of the wrong type (nothing is coerced: ``port="8000"`` is refused).
    BackendUnavailableError
        An explicit backend that cannot run here.
    SourceError, QuantemIOError
        A path that is missing or not an acquisition or a folder; an address that cannot be
        bound (in use, not on this machine).

    Examples
    --------
    >>> from quantem.gpu import browse, io
    >>> with browse.serve("/data/session-3/", port=8765) as srv:   # a folder's catalog
    ...     print(srv.url)
    http://127.0.0.1:8765/?token=...
    >>> ds = io.load("scan_master.h5", backend="cpu")
    >>> srv = browse.serve(ds, token="my-token")
    >>> import urllib.request
    >>> req = urllib.request.Request(srv.url.split("?")[0] + "api/v1/acquisitions",
    ...                              headers={"Authorization": "Bearer my-token"})
    >>> urllib.request.urlopen(req).read()                          # the JSON catalog
    >>> ds.close()           # the service now answers 410 for it
    >>> srv.stop()

    In a script, serve until Ctrl-C:

    >>> browse.serve("scan_master.h5").wait()
    """
    kind, src = _source(source)
    backend = _args.text(_OP, "backend", backend, _BACKENDS)
    if not isinstance(host, str):
        raise _args.wrong_type(_OP, "host must be a str", "an address such as '127.0.0.1'", host)
    if host == "" or host != host.strip() or "\0" in host:
        raise _args.invalid(_OP, "host is not an address", "e.g. '127.0.0.1'", repr(host))
    port = _args.integer(_OP, "port", port, minimum=0, maximum=65535)
    token = _token(token)
    memory_budget = _args.optional_integer(
        _OP, "memory_budget", memory_budget, minimum=1, maximum=_args.U64_MAX
    )
    representation = _representation(representation)
    open_browser = _args.flag(_OP, "open_browser", open_browser)
    if kind == "dataset":
        if backend != "auto" and backend != src.backend:
            raise _args.invalid(
                _OP,
                "a dataset is served on its own backend",
                f"backend='auto' or {src.backend!r}",
                repr(backend),
            )
        for name, value in (("representation", representation), ("memory_budget", memory_budget)):
            if value is not None:
                raise _args.invalid(
                    _OP,
                    f"{name} applies to loading; the dataset is already loaded",
                    f"{name}=None with a Dataset",
                    repr(value),
                )
    # The native call tells the demo from a path by type: "demo" as a str, a path as a Path.
    native = _native._browse_serve(
        pathlib.Path(src) if kind == "path" else src,
        backend,
        host,
        port,
        token,
        memory_budget,
        representation,
    )
    srv = BrowseServer(native)
    if open_browser:
        import webbrowser

        webbrowser.open(srv.url)
    return srv
