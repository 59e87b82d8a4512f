"""Console entry point: the ``quantem-gpu`` command of a pip install runs the Rust CLI."""

import signal
import sys


def main() -> None:
    """Run ``quantem-gpu`` with ``sys.argv`` and exit with its exit code."""
    from quantem.gpu import _native

    # Ctrl-C ends the command as it does the cargo-built binary (Rust code never runs Python's
    # signal handlers while it works).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = ["quantem-gpu", *sys.argv[1:]]
    code = _native.cli_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(int(code))


if __name__ == "__main__":
    main()
