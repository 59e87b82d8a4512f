"""The Python surface without a loaded dataset: names, devices, errors, console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import quantem.gpu as qg
from quantem.gpu import device, io

EXCEPTIONS = [
    "QuantemError",
    "SourceError",
    "DecodeError",
    "InvalidArgumentError",
    "DtypeOverflowError",
    "BackendUnavailableError",
    "MemoryBudgetError",
    "QuantemIOError",
    "ArgumentTypeError",
]


def test_public_names():
    for name in EXCEPTIONS + ["io", "device", "Dataset", "Dataset4dstemGPU", "__version__"]:
        assert hasattr(qg, name), name
    assert qg.Dataset4dstemGPU is qg.Dataset is io.Dataset is io.Dataset4dstemGPU
    assert isinstance(qg.__version__, str) and qg.__version__[0].isdigit()
    for name in ["load", "inspect", "discover", "save", "DataRepresentation"]:
        assert callable(getattr(io, name)), name
    assert io.DataRepresentation.DENSE.value == "dense"
    assert io.DataRepresentation.ENCODED.value == "encoded"
    assert {"available", "resolve", "info"} <= set(dir(device))


def test_exception_hierarchy():
    for name in EXCEPTIONS[1:]:
        cls = getattr(qg, name)
        assert issubclass(cls, qg.QuantemError), name
        assert cls.__module__ == "quantem.gpu"
    assert issubclass(qg.QuantemError, Exception)
    assert issubclass(qg.InvalidArgumentError, ValueError)
    assert issubclass(qg.DtypeOverflowError, ValueError)
    assert issubclass(qg.QuantemIOError, OSError)
    assert not issubclass(qg.SourceError, ValueError)
    # A wrong-typed argument is an InvalidArgumentError and still the built-in TypeError.
    assert issubclass(qg.ArgumentTypeError, qg.InvalidArgumentError)
    assert issubclass(qg.ArgumentTypeError, TypeError)


def test_device_available_and_info():
    avail = device.available()
    assert "cpu" in avail
    info = device.info()
    names = [d["name"] for d in info]
    assert {"cpu", "cuda", "mps"} <= set(names)
    for d in info:
        assert set(d) >= {"name", "available", "detail"}
        assert isinstance(d["available"], bool) and d["detail"]
    # available() is info() filtered, in the same (preference) order
    assert avail == [d["name"] for d in info if d["available"]]


def test_device_resolve():
    assert device.resolve() == device.resolve("auto") == device.available()[0]
    assert device.resolve("cpu") == "cpu"
    if "cuda" not in device.available():
        with pytest.raises(qg.BackendUnavailableError) as e:
            device.resolve("cuda")
        assert "cuda" in str(e.value).lower()
        assert len(str(e.value)) > 30  # carries a reason
    with pytest.raises(qg.BackendUnavailableError, match="(?i)metal|mps"):
        device.resolve("mps")
    with pytest.raises(qg.InvalidArgumentError) as e:
        device.resolve("tpu")
    assert e.value.found == "tpu" and e.value.expected


def test_explicit_unavailable_backend_is_an_error_not_a_cpu_run():
    arr = np.zeros((2, 2, 4, 4), np.uint16)
    for name in ("cuda", "mps"):
        if name in device.available():
            continue
        with pytest.raises(qg.BackendUnavailableError):
            io.load(arr, backend=name)


def test_error_attributes():
    with pytest.raises(qg.InvalidArgumentError) as e:
        io.load(np.zeros((2, 4, 4), np.float32))
    err = e.value
    for attr in ("kind", "op", "file", "frame", "expected", "found", "detail"):
        assert hasattr(err, attr), attr
    assert err.op == "load" and "float32" in err.found and "uint16" in err.expected
    assert str(err).startswith("load")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype="f32"),
        dict(representation="sparse"),
        dict(scan_region=(0, 1, 0)),
        dict(detector_region=(-1, 2, 0, 2)),
        dict(scan_shape=(2, -2)),
        dict(det_bin=-1),
        dict(backend="tpu"),
    ],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(qg.InvalidArgumentError):
        io.load(np.zeros((2, 2, 4, 4), np.uint16), **kwargs)


def test_invalid_source_types():
    with pytest.raises(qg.InvalidArgumentError):
        io.load(np.zeros((4, 4), np.uint16))  # 2-D
    with pytest.raises(qg.InvalidArgumentError):
        io.load(np.zeros((2, 2, 4, 4), np.int16))
    with pytest.raises(TypeError):
        io.load(12345)


def test_missing_file_is_a_typed_error(tmp_path):
    missing = tmp_path / "nope_master.h5"
    with pytest.raises(qg.QuantemError) as e:
        io.load(missing)
    assert type(e.value) is not qg.QuantemError  # a category, not the bare base class
    assert "nope_master.h5" in str(e.value)


def test_save_needs_a_dataset(tmp_path):
    with pytest.raises(TypeError):
        io.save(None, tmp_path / "x.qem")
    assert not (tmp_path / "x.qem").exists()


def _console_script() -> str | None:
    exe = Path(sys.executable).parent / "quantem-gpu"
    if exe.exists():
        return str(exe)
    return shutil.which("quantem-gpu")


def test_console_script_device_json():
    exe = _console_script()
    assert exe, "the quantem-gpu console script is not installed next to this Python"
    out = subprocess.run(
        [exe, "device", "--json"], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr
    parsed = json.loads(out.stdout)
    assert "cpu" in json.dumps(parsed)


def test_console_script_usage_error_exit_code():
    exe = _console_script()
    assert exe
    out = subprocess.run([exe, "no-such-command"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr)


def test_console_script_runs_the_shipped_binary():
    # The wheel carries the CLI as its own binary (the extension module does not link it).
    from quantem.gpu import _cli

    exe = _cli.binary_path()
    assert exe.is_file() and os.access(exe, os.X_OK), exe
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("quantem-gpu "), out


def test_console_script_without_its_binary_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    from quantem.gpu import _cli

    monkeypatch.setattr(_cli, "binary_path", lambda: tmp_path / "missing" / "quantem-gpu")
    with pytest.raises(SystemExit) as exit_info:
        _cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "missing" / "quantem-gpu") in err and "make wheel" in err
