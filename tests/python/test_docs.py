"""The documentation site: `mkdocs build --strict` succeeds (API pages from the docstrings and
the native module's stubs), and every Python example on the getting-started and example pages
runs against the demo data.

The examples run in page order in one folder, the getting-started page first (its first
example writes the demo data with the `quantem-gpu` command); each page's blocks share one
namespace, as in a notebook.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [
    "getting-started.md",
    "examples/load.md",
    "examples/products.md",
    "examples/dpc.md",
    "examples/ssb.md",
    "examples/save.md",
    "examples/browse.md",
    "examples/calibration.md",
    "examples/notebooks.md",
]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return FENCE.findall((DOCS / page).read_text(encoding="utf-8"))


def test_every_page_has_an_example():
    for page in PAGES:
        assert python_blocks(page), f"{page} has no python example"


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for page in PAGES:
        html = out / page.replace(".md", "") / "index.html"
        assert html.is_file(), html
    # API pages are rendered from the docstrings: the functions are there by name.
    api = (out / "api" / "results" / "index.html").read_text(encoding="utf-8")
    assert "nice_scale_bar" in api and "Axis" in api
    io_page = (out / "api" / "io" / "index.html").read_text(encoding="utf-8")
    assert "scan_region" in io_page and "nbytes_resident" in io_page
    assert (out / "formats" / "index.html").is_file()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("examples")
    old = os.getcwd()
    old_path = os.environ.get("PATH", "")
    # The console script lives beside this Python in a pip install.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + old_path
    os.chdir(d)
    try:
        yield d
    finally:
        os.chdir(old)
        os.environ["PATH"] = old_path


@pytest.mark.parametrize("page", PAGES)
def test_examples_run(page, workdir):
    if page != PAGES[0] and not (workdir / "quantem-demo" / "demo_master.h5").is_file():
        for block in python_blocks(PAGES[0])[:1]:
            exec(compile(block, f"{PAGES[0]}[0]", "exec"), {"__name__": "__docs__"})
    ns: dict = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page)):
        exec(compile(block, f"{page}[{i}]", "exec"), ns)
