"""Console entry point: the ``quantem-gpu`` command of a pip install runs the Rust CLI binary.

The binary is built by ``cargo build -p qem-cli`` and staged into ``quantem/gpu/_bin`` by
``scripts/stage_cli.sh`` before the wheel is built (``make wheel`` does both), so the extension
module does not link the command line (its argument parser, its output code) and the command
starts without importing Python packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_BINARY = "quantem-gpu.exe" if os.name == "nt" else "quantem-gpu"


def binary_path() -> Path:
    """Where this install keeps the ``quantem-gpu`` binary (it may be missing: see `main`)."""
    return Path(__file__).resolve().parent / "_bin" / _BINARY


def main() -> None:
    """Run the ``quantem-gpu`` binary with ``sys.argv`` in place of this process."""
    exe = binary_path()
    if not exe.is_file():
        sys.stderr.write(
            f"quantem-gpu: the command-line binary is not in this install (expected {exe}); "
            "it is built with the wheel by `make wheel` (scripts/stage_cli.sh), or run "
            "`cargo run --release -p qem-cli -- ...` from a checkout\n"
        )
        sys.exit(2)
    argv = [str(exe), *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        # Replace this process: signals (Ctrl-C), exit codes and streams are the binary's own.
        os.execv(argv[0], argv)
    sys.exit(subprocess.call(argv))


if __name__ == "__main__":
    main()
