"""The browse page in a real browser (headless Chromium through Playwright).

A small acquisition (rectangular scan, odd detector so that det_bin 2 has partial edge blocks, a
bright disk for the BF fit) is served on the CPU; the page is opened, the virtual detector dragged,
a scan position clicked (pinned, unpinned, hovered), det_bin switched, a scan ROI shift-dragged,
contrast and colour map changed, an annulus resized by its handle, a rectangle's corner dragged,
scan_bin switched, CoM shown, an SSB error shown, and SSB prepared and reconstructed as its C10
slider moves. After each step the pixels the page shows (``getImageData`` of its native-resolution
canvases) are compared with the display mapping documented in ``crates/qem-serve/web/app.js`` and
``docs/browse.md`` ("The page"), recomputed here in NumPy from the array the test fetches from the
API itself: the page must show the API's array, through that mapping, for the geometry it says it
used. The API's own values are checked against the engine by ``test_browse_api.py``.

Needs Chromium (``chromium`` on PATH; ``scripts/setup.sh`` installs it) and the ``playwright``
package; without Chromium the test skips, except where ``CI`` is set. Screenshots go to
``$QEM_ARTIFACTS/browse-page`` or a pytest temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers import console_script, write_acquisition

SCAN = (9, 11)
DET = (26, 30)
DISK = (12.3, 14.6, 6.0)  # centre row, centre col, radius of the bright disk (detector pixels)
TOKEN = "page-test-token"
SETTINGS = ("plo", "phi", "transform", "gamma", "cmap")
REPO = Path(__file__).resolve().parents[2]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def unavailable(reason: str):
    """Skip outside CI; in CI (setup.sh installs everything) a missing piece is a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the browser test must run)")
    pytest.skip(reason)


# ----------------------------------------------------------------------------- the service


def acquisition(tmp: Path) -> Path:
    """Poisson frames: a disk whose brightness varies over the scan on a dim background."""
    rng = np.random.default_rng(7)
    i, j = np.mgrid[: DET[0], : DET[1]].astype(np.float64)
    inside = (i - DISK[0]) ** 2 + (j - DISK[1]) ** 2 <= DISK[2] ** 2
    r, c = np.mgrid[: SCAN[0], : SCAN[1]].astype(np.float64)
    level = 30 + 20 * np.sin(r / 2.0) * np.cos(c / 3.0)  # per scan position
    lam = np.where(inside, level[..., None, None], 2.0 + 0.05 * j)
    data = rng.poisson(lam).astype(np.uint16)
    master, _, _ = write_acquisition(tmp, name="page", data=data, dtype=np.uint16, fpf=40)
    return master


class Service:
    """The browse service on ``master``: ``quantem.gpu.browse.serve`` when the installed package
    has it, else the ``quantem-gpu serve`` command (console script or target/release)."""

    def __init__(self, master: Path):
        self.proc = None
        self.srv = None
        if os.environ.get("QEM_BROWSE_URL"):  # a service already running (any acquisition)
            self.url = os.environ["QEM_BROWSE_URL"]
            return
        try:
            from quantem.gpu import browse

            self.srv = browse.serve(str(master), backend="cpu", token=TOKEN)
            self.url = self.srv.url
            return
        except (ImportError, AttributeError, NotImplementedError):
            pass  # the binding is not in this build: use the command
        exe = console_script() or str(REPO / "target" / "release" / "quantem-gpu")
        if not Path(exe).exists():
            unavailable("neither quantem.gpu.browse.serve nor a quantem-gpu binary is available")
        cmd = [exe, "serve", str(master), "--backend", "cpu", "--port", "0", "--token", TOKEN]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"https?://[^\s]+token=[^\s]+", line)
            if m:
                self.url = m.group(0)
                # Keep reading what it prints, so that a full pipe never blocks the service.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
        self.proc.kill()
        pytest.fail(f"{' '.join(cmd)} printed no URL:\n{''.join(seen)}")

    @property
    def base(self) -> str:
        u = urllib.parse.urlsplit(self.url)
        return f"{u.scheme}://{u.netloc}/"

    def get(self, path: str) -> tuple[bytes, dict]:
        token = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.url).query)).get(
            "token", TOKEN
        )
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.read(), {k.lower(): v for k, v in res.headers.items()}

    def json(self, path: str):
        return json.loads(self.get("api/v1/" + path)[0])

    def array(self, path: str) -> np.ndarray:
        """An array route as float64 values (a mean divided by X-Divisor), as the page reads it."""
        body, h = self.get(path)
        shape = tuple(int(n) for n in h["x-shape"].split(","))
        a = np.frombuffer(body, dtype=np.dtype(h["x-dtype"]).newbyteorder("<")).reshape(shape)
        a = a.astype(np.float64)
        return a / int(h["x-divisor"]) if "x-divisor" in h else a

    def stop(self):
        if self.srv is not None:
            self.srv.stop()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ----------------------------------------------------------------------------- the mapping


def display_index(values: np.ndarray, s: dict) -> np.ndarray:
    """The page's documented display mapping: values -> colour-table index 0..255."""
    v = values.astype(np.float64)
    if s["transform"] == "log":
        offset = v[np.isfinite(v)].min()
        v = np.log1p(v - offset)
    fin = np.isfinite(v)
    srt = np.sort(v[fin])
    k = lambda p: int(np.floor(p / 100 * (srt.size - 1) + 0.5))  # noqa: E731
    lo, hi = srt[k(s["plo"])], srt[k(s["phi"])]
    if not hi > lo:
        return np.zeros(v.shape, np.int64)
    t = np.clip((v - lo) / (hi - lo), 0, 1)
    t[~fin] = 0
    if s["transform"] == "gamma":
        t = t ** s["gamma"]
    return np.floor(255 * t + 0.5).astype(np.int64)


class Page:
    def __init__(self, page, artifacts: Path):
        self.page = page
        self.artifacts = artifacts
        self.shots = 0

    def idle(self):
        self.page.evaluate("window.qemBrowse.idle()")

    def shot(self, name: str):
        self.shots += 1
        self.page.screenshot(
            path=str(self.artifacts / f"{self.shots:02d}-{name}.png"), full_page=True
        )

    def canvas(self, view: str) -> tuple[np.ndarray, dict]:
        """The RGBA pixels of a view's canvas and its data-* attributes."""
        got = self.page.evaluate(
            """(id) => { const c = document.getElementById(id);
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 return {w: c.width, h: c.height, px: Array.from(d), ds: {...c.dataset}}; }""",
            f"view-{view}",
        )
        px = np.array(got["px"], np.int64).reshape(got["h"], got["w"], 4)
        return px, got["ds"]

    def box(self, selector: str) -> dict:
        b = self.page.locator(selector).bounding_box()
        assert b is not None, selector
        return b

    def at(self, view: str, row: float, col: float, shape) -> tuple[float, float]:
        """CSS coordinates of array position (row, col) (pixel edges at integers) of a view."""
        b = self.box(f"#view-{view}")
        return b["x"] + col * b["width"] / shape[1], b["y"] + row * b["height"] / shape[0]

    def check_view(self, service: Service, view: str, route: str, params: dict):
        """The view shows the API's array for ``route`` and ``params`` (numbers to 0.011, the
        page rounds geometry to 0.01) through the documented display mapping."""
        px, ds = self.canvas(view)
        url = urllib.parse.urlsplit(ds["url"])
        got = dict(urllib.parse.parse_qsl(url.query))
        assert url.path == route and set(got) == set(params), (view, ds["url"], route, params)
        for k, v in params.items():
            if isinstance(v, float):
                assert abs(float(got[k]) - v) <= 0.011, (view, k, got[k], v)
            else:
                assert got[k] == str(v), (view, k, got[k], v)
        want = service.array(ds["url"])
        assert px.shape[:2] == want.shape, (view, px.shape, want.shape)
        s = {k: ds[k] if k in ("transform", "cmap") else float(ds[k]) for k in SETTINGS}
        idx = display_index(want, s)
        assert s["cmap"] == "gray"
        gray = (px[..., 0] == px[..., 1]) & (px[..., 1] == px[..., 2]) & (px[..., 3] == 255)
        assert gray.all(), view
        diff = np.abs(px[..., 0] - idx)
        assert diff.max() <= 1, (view, ds["url"], int(diff.max()), int((diff > 1).sum()))
        return want, px


# ----------------------------------------------------------------------------- the test


@pytest.fixture
def artifacts(tmp_path):
    root = Path(os.environ["QEM_ARTIFACTS"]) if os.environ.get("QEM_ARTIFACTS") else tmp_path
    out = root / "browse-page"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_browse_page(tmp_path, artifacts):
    chromium = chromium_path()
    if chromium is None:
        unavailable("chromium is not installed (scripts/setup.sh installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed (scripts/setup.sh installs it)")

    service = Service(acquisition(tmp_path))
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
            try:
                page = browser.new_page(
                    viewport={"width": 1280, "height": 1000}, accept_downloads=True
                )
                run_page(page, service, artifacts)
            finally:
                browser.close()
    finally:
        service.stop()


def run_page(page, service: Service, artifacts: Path):
    errors, virtual_sent, virtual_max, inflight = [], [0], [0], [0]
    page.on("pageerror", lambda e: errors.append(str(e)))

    # Count the virtual-image requests in flight: the page must never have more than one.
    def started(req):
        if "/virtual?" in req.url:
            inflight[0] += 1
            virtual_sent[0] += 1
            virtual_max[0] = max(virtual_max[0], inflight[0])

    def ended(req):
        if "/virtual?" in req.url:
            inflight[0] -= 1

    page.on("request", started)
    page.on("requestfinished", ended)
    page.on("requestfailed", ended)
    p = Page(page, artifacts)

    page.goto(service.url)
    page.evaluate("window.qemBrowse.ready")
    p.idle()
    p.shot("ready")
    acq_id = service.json("acquisitions")[0]["id"]
    acq = service.json(f"acquisitions/{acq_id}")
    scan, det = acq["shape"][:2], acq["shape"][2:]
    a = f"api/v1/acquisitions/{urllib.parse.quote(acq_id)}"
    route = lambda r: urllib.parse.urlsplit(service.base + a + "/" + r).path[1:]  # noqa: E731

    # 1. The mean DP (log scale by default) and the BF image about the fitted disk.
    p.check_view(service, "dp", route("dp"), {"reduce": "mean", "det_bin": 1})
    assert p.canvas("dp")[1]["transform"] == "log"
    p.check_view(service, "virtual", route("virtual"), {"mode": "bf", "det_bin": 1, "scan_bin": 1})

    # 2. Drag the detector's centre by (+2 rows, +3 cols) of detector pixels; the virtual image
    # follows live (several requests, never two in flight) and ends at the dragged geometry.
    disk = acq["disk"]
    x0, y0 = p.at("dp", disk["row"] + 0.5, disk["col"] + 0.5, det)
    x1, y1 = p.at("dp", disk["row"] + 2.5, disk["col"] + 3.5, det)
    before = virtual_sent[0]
    page.mouse.move(x0, y0)
    page.mouse.down()
    for k in range(1, 13):
        page.mouse.move(x0 + (x1 - x0) * k / 12, y0 + (y1 - y0) * k / 12)
        page.wait_for_timeout(15)
    page.mouse.up()
    p.idle()
    p.shot("dragged")
    named = page.evaluate("window.qemBrowse.state.named")
    assert abs(named["row"] - (disk["row"] + 2.5)) < 0.02, (named, disk)
    assert abs(named["col"] - (disk["col"] + 3.5)) < 0.02, (named, disk)
    assert virtual_sent[0] - before >= 2, "the virtual image did not update during the drag"
    assert virtual_max[0] == 1, f"{virtual_max[0]} virtual-image requests were in flight at once"
    bf = {
        "mode": "bf",
        "det_bin": 1,
        "scan_bin": 1,
        "cr": disk["row"] + 2,
        "cc": disk["col"] + 3,
        "radius": float(disk["radius"]),
    }
    p.check_view(service, "virtual", route("virtual"), bf)

    # 3. Click a scan position: its frame is shown (pinned) in the diffraction panel.
    r, c = scan[0] // 2, (2 * scan[1]) // 3
    page.mouse.click(*p.at("virtual", r + 0.5, c + 0.5, scan))
    p.idle()
    p.shot("frame")
    p.check_view(service, "dp", route("frame"), {"r": r, "c": c, "det_bin": 1})

    # A second click unpins; the frame then follows the mouse.
    page.mouse.click(*p.at("virtual", r + 0.5, c + 0.5, scan))
    page.mouse.move(*p.at("virtual", r - 0.5, c - 0.5, scan), steps=3)
    p.idle()
    p.check_view(service, "dp", route("frame"), {"r": r - 1, "c": c - 1, "det_bin": 1})
    page.mouse.click(*p.at("virtual", r + 0.5, c + 0.5, scan))  # pinned at (r, c) again
    p.idle()

    # 4. det_bin 2: the frame and the virtual image at the binned geometry (a partial edge block
    # where the detector is odd).
    page.select_option("#det-bin", "2")
    p.idle()
    p.shot("det-bin-2")
    p.check_view(service, "dp", route("frame"), {"r": r, "c": c, "det_bin": 2})
    assert p.canvas("dp")[0].shape[:2] == (-(-det[0] // 2), -(-det[1] // 2))
    bf2 = {
        "mode": "bf",
        "det_bin": 2,
        "scan_bin": 1,
        "cr": (named["row"]) / 2 - 0.5,
        "cc": named["col"] / 2 - 0.5,
        "radius": named["radius"] / 2,
    }
    p.check_view(service, "virtual", route("virtual"), bf2)

    # 5. Shift-drag a scan rectangle: the mean DP over it.
    page.keyboard.down("Shift")
    page.mouse.move(*p.at("virtual", 1.5, 2.5, scan))
    page.mouse.down()
    page.mouse.move(*p.at("virtual", 3.5, 5.5, scan), steps=4)
    page.mouse.up()
    page.keyboard.up("Shift")
    p.idle()
    p.shot("roi")
    roi = {"r0": 1, "r1": 4, "c0": 2, "c1": 6, "reduce": "mean", "det_bin": 2}
    p.check_view(service, "dp", route("roi-dp"), roi)

    # 6. Percentile contrast on the virtual image, then a colour map (its end colours).
    view = "#virtual-view"
    page.fill(f"{view} .plo", "2")
    page.fill(f"{view} .phi", "97.5")
    page.locator(f"{view} .phi").dispatch_event("change")
    want, _ = p.check_view(service, "virtual", route("virtual"), bf2)
    page.select_option(f"{view} .cmap", "viridis")
    px, _ = p.canvas("virtual")
    idx = display_index(want, {"plo": 2, "phi": 97.5, "transform": "linear", "gamma": 1})
    assert (px[idx == 0][:, :3] == [0x44, 0x01, 0x54]).all()
    assert (px[idx == 255][:, :3] == [0xFD, 0xE7, 0x25]).all()
    p.shot("viridis")

    # 7. The .npy download is the API's array.
    with page.expect_download() as dl:
        page.click(f"{view} .save-npy")
    saved = artifacts / "virtual.npy"
    dl.value.save_as(str(saved))
    assert np.array_equal(np.load(saved).astype(np.float64), want)
    with page.expect_download() as dl:
        page.click(f"{view} .save-png")
    png = artifacts / "virtual.png"
    dl.value.save_as(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # 8. A custom annulus (from the fitted disk), its inner handle dragged out by 2 binned pixels.
    page.select_option(f"{view} .cmap", "gray")
    page.select_option("#det-shape", "annulus")
    p.idle()
    shape = page.evaluate("window.qemBrowse.state.shape")
    row, col, inner = shape["row"] / 2, shape["col"] / 2, shape["inner"] / 2  # binned view units
    binned = p.canvas("dp")[0].shape[:2]
    page.mouse.move(*p.at("dp", row, col + inner, binned))
    page.mouse.down()
    page.mouse.move(*p.at("dp", row, col + inner + 2, binned), steps=5)
    page.mouse.up()
    p.idle()
    p.shot("annulus")
    annulus = {
        "mode": "annulus",
        "det_bin": 2,
        "scan_bin": 1,
        "cr": row - 0.5,
        "cc": col - 0.5,
        "inner": inner + 2,
        "outer": shape["outer"] / 2,
    }
    p.check_view(service, "virtual", route("virtual"), annulus)

    # A rectangle (from the fitted disk's bounding box), its lower-right corner dragged to the
    # binned pixel boundary nearest the pointer: its edges stay on binned pixel boundaries.
    page.select_option("#det-shape", "rect")
    p.idle()
    rect = page.evaluate("window.qemBrowse.state.shape")
    r1, c1 = rect["r1"] // 2 + 1, rect["c1"] // 2 + 1  # the target boundaries (binned)
    page.mouse.move(*p.at("dp", rect["r1"] / 2, rect["c1"] / 2, binned))
    page.mouse.down()
    page.mouse.move(*p.at("dp", r1 + 0.2, c1 + 0.2, binned), steps=4)
    page.mouse.up()
    p.idle()
    edges = {"r0": rect["r0"] / 2, "r1": r1, "c0": rect["c0"] / 2, "c1": c1}
    box = {k: float(v - 0.5) for k, v in edges.items()}  # the API takes pixel centres
    p.check_view(
        service, "virtual", route("virtual"), {"mode": "rect", "det_bin": 2, "scan_bin": 1, **box}
    )
    page.select_option("#det-shape", "annulus")  # back to the annulus checked above
    page.mouse.move(*p.at("dp", row, col + inner, binned))
    page.mouse.down()
    page.mouse.move(*p.at("dp", row, col + inner + 2, binned), steps=5)
    page.mouse.up()
    p.idle()

    # 9. scan_bin 2 (whole 2 x 2 blocks; a last odd row or column dropped) and CoM magnitude
    # (float32, computed at det_bin 1).
    page.select_option("#scan-bin", "2")
    p.idle()
    p.check_view(service, "virtual", route("virtual"), {**annulus, "scan_bin": 2})
    assert p.canvas("virtual")[0].shape[:2] == (scan[0] // 2, scan[1] // 2)
    page.select_option("#scan-bin", "1")
    page.select_option("#mode", "com_mag")
    p.idle()
    p.shot("com")
    p.check_view(
        service, "virtual", route("virtual"), {"mode": "com_mag", "det_bin": 1, "scan_bin": 1}
    )

    # 10. SSB. A negative semiangle is refused by the service: its error must be shown in the
    # status line. Then prepare with typed parameters, reconstruct, move the C10 slider.
    page.fill("#ssb-voltage", "300")
    page.fill("#ssb-step", "0.4")
    page.fill("#ssb-semiangle", "-1")
    page.click("#ssb-prepare")
    page.wait_for_function("document.getElementById('status').dataset.kind === 'error'")
    assert "semiangle" in page.text_content("#status"), page.text_content("#status")
    page.fill("#ssb-voltage", "300")
    page.fill("#ssb-semiangle", "20")
    page.fill("#ssb-step", "0.4")
    page.click("#ssb-prepare")
    page.wait_for_function("!document.getElementById('ssb-C10').disabled", timeout=60000)
    p.idle()
    p.check_view(
        service, "ssb", route("ssb/reconstruct"), {"C10": 0, "C12": 0, "phi12": 0, "part": "phase"}
    )
    page.locator("#ssb-C10").fill("120")  # an input event, as a slider move
    page.wait_for_timeout(100)  # the 40 ms debounce
    p.idle()
    p.shot("ssb")
    params = {"C10": 120, "C12": 0, "phi12": 0, "part": "phase"}
    p.check_view(service, "ssb", route("ssb/reconstruct"), params)

    status = page.evaluate(
        "[document.getElementById('status').dataset.kind, "
        "document.getElementById('status').textContent]"
    )
    assert status[0] != "error", status
    assert not errors, errors
