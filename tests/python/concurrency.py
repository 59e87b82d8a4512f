"""One piece of work on several threads at once (tests/python/test_cycles.py and, by path,
tests/gpu/soak.py): what is checked is that threads loading and reducing together agree."""

from __future__ import annotations

import threading
from typing import Callable


def on_threads(work: Callable[[int], None], n: int) -> list[str]:
    """Runs ``work(i)`` for ``i`` in ``range(n)``, each on its own thread, all started before
    any is joined; returns the errors raised, each naming its thread (empty when none)."""
    errors: list[str] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except Exception as e:  # every error goes back to the caller, naming the thread
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
