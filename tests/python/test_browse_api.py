"""The browse service started from Python (``quantem.gpu.browse``), checked over HTTP.

The service runs on the CPU in this process; requests go through ``urllib`` (no extra test
dependency). Expected values come from the engine's own public functions (``ds[r, c]``,
``detector.sum_dp``, ``detector.bf``, ``detector.virtual_image`` with a mask built here) or from
NumPy, never from the service. The contract is ``docs/browse.md``.
"""

from __future__ import annotations

import html
import io as _io
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from helpers import bin_reference, h5py_dectris, write_acquisition

import quantem.gpu as qg
from quantem.gpu import browse, detector, device, dpc, io, ssb

SCAN = (5, 7)
DET = (11, 13)
TOKEN = "test-token_0.1~"


def disk_counts(scan, det, center, radius, seed, dtype=np.uint32):
    """Poisson frames with a bright disk (so the BF fit finds one)."""
    rng = np.random.default_rng(seed)
    i, j = np.mgrid[: det[0], : det[1]].astype(np.float64)
    lam = np.where((i - center[0]) ** 2 + (j - center[1]) ** 2 <= radius**2, 40.0, 2.0)
    return rng.poisson(lam, size=tuple(scan) + tuple(det)).astype(dtype)


# ----------------------------------------------------------------------------- HTTP helpers


class Answer:
    """One HTTP answer: status, headers (lower-case names), body."""

    def __init__(self, status: int, headers, body: bytes):
        self.status = status
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.body = body

    def json(self):
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        return json.loads(self.body)

    def array(self) -> np.ndarray:
        """The raw little-endian C-order body described by X-Shape / X-Dtype."""
        assert self.status == 200, (self.status, self.body[:300])
        assert self.headers["content-type"].startswith("application/octet-stream"), self.headers
        shape = tuple(int(n) for n in self.headers["x-shape"].split(","))
        dtype = np.dtype(self.headers["x-dtype"]).newbyteorder("<")
        assert len(self.body) == dtype.itemsize * int(np.prod(shape)), (shape, dtype)
        return np.frombuffer(self.body, dtype=dtype).reshape(shape)

    def error_kind(self) -> str:
        """The ``kind`` of a JSON error answer (checked to have the documented form)."""
        doc = self.json()
        assert set(doc) == {"error"}, doc
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"], doc
        return doc["error"]["kind"]


#: No proxy: the service is on this machine whatever ``http_proxy`` says.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def base(srv) -> str:
    return f"http://{srv.host}:{srv.port}"


def request(srv, route: str, params=None, token=TOKEN, method="GET", body=None, headers=None):
    """``route`` on ``srv``; ``token`` goes into ``?token=`` (None: no token at all)."""
    q = dict(params or {})
    if token is not None:
        q["token"] = token
    url = base(srv) + route + ("?" + urllib.parse.urlencode(q) if q else "")
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with OPENER.open(req, timeout=60) as r:
            return Answer(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.headers, e.read())


def acq(srv, token=TOKEN) -> str:
    """The id of the only acquisition served."""
    a = request(srv, "/api/v1/acquisitions", token=token)
    assert a.status == 200, a.body
    items = a.json()
    assert len(items) == 1, items
    return items[0]["id"]


def api(srv, aid: str, view: str, token=TOKEN, **params) -> Answer:
    return request(srv, f"/api/v1/acquisitions/{urllib.parse.quote(aid)}/{view}", params, token)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A Dectris acquisition with a BF disk: u32 counts, rectangular scan, odd detector."""
    tmp = tmp_path_factory.mktemp("browse")
    counts = disk_counts(SCAN, DET, center=(5.2, 6.4), radius=3.1, seed=7)
    master, _, written = write_acquisition(tmp, name="disk", data=counts)
    assert np.array_equal(h5py_dectris(master).reshape(SCAN + DET), written)
    return {"master": master, "counts": written}


@pytest.fixture(scope="module")
def ds(data):
    with io.load(data["master"], backend="cpu", apply_mask=False) as d:
        yield d


@pytest.fixture(scope="module")
def srv(ds):
    with browse.serve(ds, token=TOKEN) as s:
        yield s


# ----------------------------------------------------------------------------- the handle


def test_handle_attributes(srv):
    assert srv.host == "127.0.0.1"
    assert isinstance(srv.port, int) and 0 < srv.port < 65536
    assert srv.token == TOKEN
    assert srv.url == f"http://127.0.0.1:{srv.port}/?token={TOKEN}"
    assert not srv.stopped
    assert repr(srv) == f"BrowseServer({srv.url})"
    assert isinstance(srv, browse.BrowseServer)
    assert qg.browse is browse


def test_random_token_is_32_bytes_hex(ds):
    with browse.serve(ds) as s:
        tok = s.token
        assert isinstance(tok, str) and len(tok) == 64
        int(tok, 16)
        assert s.url.endswith(f"?token={tok}")
        assert request(s, "/api/v1/capabilities", token=tok).status == 200
        assert request(s, "/api/v1/capabilities", token=TOKEN).status == 401
    with browse.serve(ds) as other:
        assert other.token != tok


def test_repr_html_is_an_iframe_of_the_url(srv):
    page = srv._repr_html_()
    assert "<iframe" in page
    assert f'src="{srv.url}"' in page


def test_the_page_loads_with_the_token(srv):
    a = request(srv, "/")
    assert a.status == 200
    assert a.headers["content-type"].startswith("text/html")


def test_the_page_assets_load_without_the_cookie(srv):
    """What a Jupyter IFrame needs: the page loaded with ``?token=`` must bring its own assets
    without the cookie (seen in Chromium: a notebook page on ``localhost`` framing the service
    on ``127.0.0.1`` got 401 for both assets and showed an empty page)."""
    page = request(srv, "/")
    assert page.status == 200
    assets = re.findall(r'(?:src|href)="((?:\./)?static/[^"]+)"', page.body.decode())
    assert assets, page.body[:300]
    for asset in assets:
        url = urllib.parse.urljoin(srv.url, html.unescape(asset))
        try:
            with OPENER.open(url, timeout=30) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        assert status == 200, (asset, status)


# ----------------------------------------------------------------------------- JSON routes


def test_capabilities(srv):
    a = request(srv, "/api/v1/capabilities")
    assert a.status == 200
    cap = a.json()
    assert cap["protocol"] == "quantem-gpu-browse"
    assert cap["version"] == 1
    assert cap["backend"] == "cpu"
    assert isinstance(cap["devices"], list)
    assert {"budget_bytes", "resident_bytes"} <= set(cap["memory"])
    assert isinstance(cap["limits"], dict)


def test_acquisitions_describe_the_dataset(srv, ds):
    a = request(srv, "/api/v1/acquisitions")
    assert a.status == 200
    (item,) = a.json()
    assert {"id", "name", "path", "ready", "reason", "loaded", "shape", "dtype"} <= set(item)
    assert item["ready"] is True
    assert item["loaded"] is True
    assert item["shape"] == list(ds.shape)
    assert item["dtype"] == "uint32"
    assert item["representation"] == "dense"
    assert item["nbytes_resident"] == ds.nbytes_resident
    one = request(srv, f"/api/v1/acquisitions/{urllib.parse.quote(item['id'])}")
    assert one.status == 200
    doc = one.json()
    assert doc["shape"] == list(ds.shape)
    for key in ("metadata", "provenance", "calibration", "disk"):
        assert key in doc, key
    fit = detector.fit_disk(ds)
    assert doc["disk"]["row"] == pytest.approx(fit.center_px[0], abs=1e-6)
    assert doc["disk"]["col"] == pytest.approx(fit.center_px[1], abs=1e-6)
    assert doc["disk"]["radius"] == pytest.approx(fit.radius_px, abs=1e-6)


def test_unknown_acquisition_is_404(srv):
    a = request(srv, "/api/v1/acquisitions/no-such-id/frame", {"r": 0, "c": 0})
    assert a.status == 404
    assert a.error_kind() == "not_found"


# ----------------------------------------------------------------------------- arrays


@pytest.mark.parametrize("rc", [(0, 0), (2, 3), (4, 6)])
def test_frame_det_bin_1_is_ds_frame(srv, ds, rc):
    r, c = rc
    a = api(srv, acq(srv), "frame", r=r, c=c, det_bin=1)
    got = a.array()
    want = ds[r, c]
    assert got.dtype == want.dtype == np.uint32
    assert np.array_equal(got, want)
    assert a.headers["x-det-bin"] == "1"


def test_frame_det_bin_2_is_exact_block_sums(srv, ds):
    a = api(srv, acq(srv), "frame", r=3, c=5, det_bin=2)
    got = a.array()
    assert got.dtype == np.uint64  # u32 counts widen to u64
    # Odd detector: the last block row and column hold fewer pixels.
    assert got.shape == (6, 7)
    assert np.array_equal(got, bin_reference(ds[3, 5], 2))
    assert a.headers["x-det-bin"] == "2"


def test_frame_out_of_range_is_400(srv):
    aid = acq(srv)
    for r, c in [(SCAN[0], 0), (0, SCAN[1]), (-1, 0)]:
        a = api(srv, aid, "frame", r=r, c=c)
        assert a.status == 400, (r, c, a.status)
        assert a.error_kind() == "bad_request"


def test_dp_sum_and_mean(srv, ds):
    aid = acq(srv)
    total = api(srv, aid, "dp", reduce="sum")
    want = detector.sum_dp(ds)
    got = total.array()
    assert got.dtype == np.uint64
    assert np.array_equal(got, want)
    assert "x-divisor" not in total.headers
    mean = api(srv, aid, "dp", reduce="mean")
    assert np.array_equal(mean.array(), want)  # the body of a mean is the exact sum
    assert int(mean.headers["x-divisor"]) == SCAN[0] * SCAN[1]
    np.testing.assert_allclose(
        mean.array() / int(mean.headers["x-divisor"]), detector.mean_dp(ds), rtol=1e-6
    )


def test_dp_max(srv, ds):
    got = api(srv, acq(srv), "dp", reduce="max").array()
    assert got.dtype == np.uint32
    assert np.array_equal(got, detector.max_dp(ds))


def test_dp_sum_det_bin_2(srv, ds):
    got = api(srv, acq(srv), "dp", reduce="sum", det_bin=2).array()
    assert np.array_equal(got, bin_reference(detector.sum_dp(ds), 2))


def test_roi_dp_sum(srv, data):
    got = api(srv, acq(srv), "roi-dp", r0=1, r1=4, c0=2, c1=7, reduce="sum").array()
    want = data["counts"][1:4, 2:7].astype(np.uint64).sum(axis=(0, 1), dtype=np.uint64)
    assert np.array_equal(got, want)


def test_virtual_bf_is_detector_bf(srv, ds):
    got = api(srv, acq(srv), "virtual", mode="bf").array()
    want = np.asarray(detector.bf(ds))
    assert got.dtype == np.uint64 == want.dtype
    assert got.shape == SCAN
    assert np.array_equal(got, want)


def test_virtual_rect_is_virtual_image_of_the_rect(srv, ds):
    r0, r1, c0, c1 = 2, 7, 3, 11
    got = api(srv, acq(srv), "virtual", mode="rect", r0=r0, r1=r1, c0=c0, c1=c1).array()
    mask = np.zeros(DET, bool)
    mask[r0:r1, c0:c1] = True  # half-open, like every region
    assert np.array_equal(got, detector.virtual_image(ds, mask))


def test_virtual_annulus_is_virtual_image_of_the_annulus(srv, ds):
    cr, cc, inner, outer = 5.3, 6.1, 1.5, 4.2  # no pixel centre on a boundary
    got = api(
        srv, acq(srv), "virtual", mode="annulus", cr=cr, cc=cc, inner=inner, outer=outer
    ).array()
    i, j = np.mgrid[: DET[0], : DET[1]].astype(np.float64)
    d2 = (i - cr) ** 2 + (j - cc) ** 2
    mask = (inner**2 <= d2) & (d2 <= outer**2)
    assert np.array_equal(got, detector.virtual_image(ds, mask))


def test_virtual_rect_det_bin_2_sums_whole_blocks(srv, ds):
    # Binned pixels (rows 1..2, cols 1..4) selected; each stands for its 2x2 original block
    # (the last column block of the 13-wide detector holds one column).
    r0, r1, c0, c1 = 1, 3, 1, 7
    got = api(srv, acq(srv), "virtual", mode="rect", r0=r0, r1=r1, c0=c0, c1=c1, det_bin=2)
    binned = np.zeros((6, 7), bool)
    binned[r0:r1, c0:c1] = True
    mask = np.kron(binned, np.ones((2, 2), bool))[: DET[0], : DET[1]]
    assert np.array_equal(got.array(), detector.virtual_image(ds, mask))
    assert got.headers["x-det-bin"] == "2"


def test_virtual_scan_bin_2_drops_the_partial_blocks(srv, ds):
    got = api(srv, acq(srv), "virtual", mode="bf", scan_bin=2)
    bf = np.asarray(detector.bf(ds))
    want = bf[:4, :6].reshape(2, 2, 3, 2).sum(axis=(1, 3), dtype=np.uint64)
    assert np.array_equal(got.array(), want)
    assert got.headers["x-scan-bin"] == "2"


def test_virtual_mask_post_is_virtual_image(srv, ds):
    rng = np.random.default_rng(3)
    mask = (rng.random(DET) < 0.4).astype(np.uint8)
    aid = urllib.parse.quote(acq(srv))
    a = request(
        srv,
        f"/api/v1/acquisitions/{aid}/virtual-mask",
        method="POST",
        body=mask.tobytes(),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert np.array_equal(a.array(), detector.virtual_image(ds, mask.astype(bool)))


def test_npy_format_is_the_raw_answer(srv):
    aid = acq(srv)
    for view, params in [
        ("frame", {"r": 1, "c": 2}),
        ("frame", {"r": 1, "c": 2, "det_bin": 2}),
        ("dp", {"reduce": "sum"}),
        ("virtual", {"mode": "bf"}),
    ]:
        raw = api(srv, aid, view, **params).array()
        npy = api(srv, aid, view, format="npy", **params)
        assert npy.status == 200, (view, npy.body[:200])
        assert "attachment" in npy.headers.get("content-disposition", ""), npy.headers
        loaded = np.load(_io.BytesIO(npy.body), allow_pickle=False)
        assert loaded.dtype == raw.dtype and loaded.shape == raw.shape, view
        assert np.array_equal(loaded, raw), view


def test_dp_max_det_bin_4_is_the_block_maximum(srv, ds):
    got = api(srv, acq(srv), "dp", reduce="max", det_bin=4).array()
    padded = np.zeros((12, 16), np.uint32)
    padded[: DET[0], : DET[1]] = detector.max_dp(ds)
    assert np.array_equal(got, padded.reshape(3, 4, 4, 4).max(axis=(1, 3)))


def test_virtual_region_crops_the_scan_before_binning(srv, ds):
    bf = np.asarray(detector.bf(ds))
    aid = acq(srv)
    got = api(srv, aid, "virtual", mode="bf", region="1,4,2,7").array()
    assert np.array_equal(got, bf[1:4, 2:7])
    got = api(srv, aid, "virtual", mode="bf", region="1,4,2,7", scan_bin=2).array()
    assert np.array_equal(got, bf[1:3, 2:6].reshape(1, 2, 2, 2).sum(axis=(1, 3)))


def test_virtual_com_and_dpc_phase_are_dpc_results(srv, ds):
    aid = acq(srv)
    com = dpc.center_of_mass(ds)
    for mode, want in [("com_row", com.com_row), ("com_col", com.com_col)]:
        a = api(srv, aid, "virtual", mode=mode, det_bin=2)
        assert a.headers["x-det-bin"] == "1"  # CoM is computed on the whole detector
        got = a.array()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
    got = api(srv, aid, "virtual", mode="dpc_phase").array()
    np.testing.assert_allclose(got, np.asarray(dpc.run(ds).phase), rtol=1e-5, atol=1e-6)


def test_ssb_reconstruct_is_ssb_reconstruct(srv, ds):
    aid = urllib.parse.quote(acq(srv))
    params = {"voltage_kv": 300.0, "semiangle_mrad": 20.0, "scan_step_a": 0.5}
    a = request(
        srv,
        f"/api/v1/acquisitions/{aid}/ssb/prepare",
        method="POST",
        body=json.dumps(params).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert a.status == 200, a.body[:300]
    assert a.json()["n_bf_pixels"] > 0
    aberrations = {"C10": 12.5, "C12": 3.0, "phi12": 0.4}
    want = ssb.SSB(ds, **params).reconstruct(aberrations)
    for part in ("phase", "amplitude"):
        route = f"/api/v1/acquisitions/{aid}/ssb/reconstruct"
        got = request(srv, route, {**aberrations, "part": part}).array()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, np.asarray(getattr(want, part)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
def test_missing_or_wrong_token_is_401_json(srv, token):
    for route in ["/api/v1/capabilities", "/api/v1/acquisitions", "/"]:
        a = request(srv, route, token=token)
        assert a.status == 401, (route, token, a.status)
        assert a.error_kind() == "unauthorized"


def test_token_in_a_bearer_header(srv):
    a = request(
        srv, "/api/v1/capabilities", token=None, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert a.status == 200
    a = request(srv, "/api/v1/capabilities", token=None, headers={"Authorization": "Bearer nope"})
    assert a.status == 401


@pytest.mark.parametrize("det_bin", ["3", "0", "16", "-1", "abc", "1.5", ""])
def test_bad_det_bin_is_400_json(srv, det_bin):
    aid = acq(srv)
    for view, params in [("frame", {"r": 0, "c": 0}), ("dp", {"reduce": "sum"})]:
        a = api(srv, aid, view, det_bin=det_bin, **params)
        assert a.status == 400, (view, det_bin, a.status, a.body[:200])
        assert a.error_kind() == "bad_request"


def test_bad_virtual_requests_are_400_json(srv):
    aid = acq(srv)
    for params in [
        {"mode": "nope"},
        {"mode": "annulus", "cr": 5, "cc": 6, "inner": 1},  # outer missing
        {"mode": "disk", "cr": "nan", "cc": 6, "radius": 2},
        {"mode": "bf", "scan_bin": 3},
        {"mode": "rect", "r0": 0, "r1": 1e9, "c0": 0, "c1": 3},
    ]:
        a = api(srv, aid, "virtual", **params)
        assert a.status == 400, (params, a.status, a.body[:200])
        assert a.error_kind() == "bad_request"


def test_bad_masks_and_bodies(srv):
    aid = urllib.parse.quote(acq(srv))
    route = f"/api/v1/acquisitions/{aid}/virtual-mask"
    a = request(srv, route, method="POST", body=b"\x01" * (DET[0] * DET[1] - 1))
    assert a.status == 400 and a.error_kind() == "bad_request"
    # The mask of the binned detector at det_bin=2 is 6 x 7; the full-size one is refused.
    a = request(srv, route, {"det_bin": 2}, method="POST", body=b"\x01" * (DET[0] * DET[1]))
    assert a.status == 400 and a.error_kind() == "bad_request"
    a = request(srv, route, method="POST", body=b"\x01" * ((16 << 20) + 1))
    assert a.status == 413 and a.error_kind() == "too_large"


def test_ids_are_not_paths(srv):
    for aid in ["..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "..", "x%00y"]:
        a = request(srv, f"/api/v1/acquisitions/{aid}/frame", {"r": 0, "c": 0})
        assert a.status == 404, (aid, a.status)
        assert a.error_kind() == "not_found"


# ----------------------------------------------------------------------------- sources


def test_serving_a_folder_lists_its_acquisitions(tmp_path):
    a_counts = disk_counts(SCAN, DET, center=(5, 6), radius=3, seed=1, dtype=np.uint16)
    b_counts = disk_counts((3, 4), DET, center=(4, 5), radius=2, seed=2, dtype=np.uint16)
    write_acquisition(tmp_path, name="first", data=a_counts, dtype=np.uint16)
    (tmp_path / "sub").mkdir()
    write_acquisition(tmp_path / "sub", name="second", data=b_counts, dtype=np.uint16)
    with browse.serve(tmp_path, backend="cpu", token=TOKEN) as s:
        a = request(s, "/api/v1/acquisitions")
        assert a.status == 200
        items = a.json()
        paths = sorted(it["path"] for it in items)
        assert paths == ["first_master.h5", "sub/second_master.h5"], items
        assert len({it["id"] for it in items}) == 2
        for it in items:
            assert str(tmp_path) not in json.dumps(it), it  # relative, never absolute
        by_path = {it["path"]: it for it in items}
        second = by_path["sub/second_master.h5"]
        frame = api(s, second["id"], "frame", r=2, c=3).array()
        assert np.array_equal(frame, b_counts[2, 3])
        total = api(s, by_path["first_master.h5"]["id"], "dp", reduce="sum").array()
        assert np.array_equal(total, a_counts.astype(np.uint64).sum(axis=(0, 1)))
        # The folder is rescanned on each listing.
        shutil.copytree(tmp_path / "sub", tmp_path / "later")
        assert len(request(s, "/api/v1/acquisitions").json()) == 3


def test_a_folder_reports_a_broken_acquisition_and_skips_links_out(tmp_path):
    counts = disk_counts(SCAN, DET, center=(5, 6), radius=3, seed=1, dtype=np.uint16)
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    _, files, _ = write_acquisition(root, name="broken", data=counts, dtype=np.uint16)
    files[-1].unlink()  # a missing shard
    outside, _, _ = write_acquisition(elsewhere, name="outside", data=counts, dtype=np.uint16)
    (root / "link_master.h5").symlink_to(outside)
    with browse.serve(root, backend="cpu", token=TOKEN) as s:
        (item,) = request(s, "/api/v1/acquisitions").json()
        assert item["path"] == "broken_master.h5"
        assert item["ready"] is False
        assert "broken_data_000005.h5" in item["reason"]
        a = api(s, item["id"], "frame", r=0, c=0)
        assert a.status == 422
        assert a.error_kind() == "source"


def test_serving_one_file(data):
    with browse.serve(data["master"], backend="cpu", token=TOKEN) as s:
        aid = acq(s)
        frame = api(s, aid, "frame", r=4, c=6).array()
        assert np.array_equal(frame, data["counts"][4, 6])


def test_serving_the_demo():
    with browse.serve("demo", backend="cpu", token=TOKEN) as s:
        items = request(s, "/api/v1/acquisitions").json()
        assert len(items) == 1
        shape = api(s, items[0]["id"], "virtual", mode="bf").array().shape
        assert shape == tuple(items[0]["shape"][:2])


def test_closing_the_dataset_makes_its_routes_410(data):
    d = io.load(data["counts"], backend="cpu")
    with browse.serve(d, token=TOKEN) as s:
        aid = acq(s)
        assert api(s, aid, "frame", r=0, c=0).status == 200
        d.close()
        for view, params in [
            ("frame", {"r": 0, "c": 0}),
            ("dp", {"reduce": "sum"}),
            ("virtual", {"mode": "bf"}),
        ]:
            a = api(s, aid, view, **params)
            assert a.status == 410, (view, a.status, a.body[:200])
            assert a.error_kind() == "closed"
        assert request(s, "/api/v1/capabilities").status == 200  # the service itself lives on


def test_close_while_requests_run(data):
    """``ds.close()`` from Python while the service computes on the dataset: nothing waits on
    anything else, every answer is the right image or 410, and the ones after close are 410."""
    counts = disk_counts((48, 48), (48, 48), center=(24, 23), radius=9, seed=5, dtype=np.uint16)
    d = io.load(counts, backend="cpu")
    want = detector.virtual_image(d, np.ones((48, 48), bool))
    with browse.serve(d, token=TOKEN) as s:
        aid = acq(s)
        answers = []

        def hammer():
            for _ in range(15):
                a = api(s, aid, "virtual", mode="rect", r0=0, r1=48, c0=0, c1=48)
                answers.append((a.status, a.array() if a.status == 200 else a.error_kind()))

        workers = [threading.Thread(target=hammer) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while not answers and time.monotonic() < deadline:
            time.sleep(0.001)
        assert answers, "no answer within 60 s"
        d.close()
        closed_at = len(answers)
        for w in workers:
            w.join(timeout=120)
            assert not w.is_alive()
        statuses = {status for status, _ in answers}
        assert statuses <= {200, 410}, statuses
        for status, body in answers:
            if status == 200:
                assert np.array_equal(body, want)
            else:
                assert body == "closed"
        # Only the request each worker had in flight when close() came may still be an image.
        late = [status for status, _ in answers[closed_at:]]
        assert late.count(200) <= len(workers), late
        assert late.count(410) >= 1, late
        assert api(s, aid, "frame", r=0, c=0).status == 410
        assert d.closed


def test_the_service_keeps_a_dropped_dataset_alive():
    import gc

    counts = disk_counts(SCAN, DET, center=(5, 6), radius=3, seed=9, dtype=np.uint16)
    with browse.serve(io.load(counts, backend="cpu"), token=TOKEN) as s:
        gc.collect()
        assert np.array_equal(api(s, acq(s), "frame", r=4, c=1).array(), counts[4, 1])


def test_loading_options_reach_the_service(tmp_path):
    counts = disk_counts(SCAN, DET, center=(5, 6), radius=3, seed=4, dtype=np.uint16)
    master, _, _ = write_acquisition(tmp_path, name="u16", data=counts, dtype=np.uint16)
    with browse.serve(master, backend="cpu", representation="encoded", token=TOKEN) as s:
        aid = acq(s)
        assert np.array_equal(api(s, aid, "frame", r=1, c=2).array(), counts[1, 2])
        (item,) = request(s, "/api/v1/acquisitions").json()
        assert item["representation"] == "encoded"
    with browse.serve(master, backend="cpu", memory_budget=1000, token=TOKEN) as s:
        assert request(s, "/api/v1/capabilities").json()["memory"]["budget_bytes"] == 1000
        a = api(s, acq(s), "frame", r=0, c=0)  # 5*7*11*13 u16 = 10010 bytes > 1000
        assert a.status == 507
        assert a.error_kind() == "memory_budget"


@pytest.mark.skipif("cuda" in device.available(), reason="CUDA is usable here")
def test_an_unusable_explicit_backend_raises(data):
    with pytest.raises(qg.BackendUnavailableError):
        browse.serve(data["master"], backend="cuda")


# ----------------------------------------------------------------------------- lifetime


def assert_port_free(port: int) -> None:
    """Another listener can take ``port`` (SO_REUSEADDR, as every server sets it, so that the
    stopped service's connections in TIME_WAIT do not count; a listener still open does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_stop_frees_the_port_and_is_idempotent(ds):
    s = browse.serve(ds, token=TOKEN)
    port = s.port
    assert request(s, "/api/v1/capabilities").status == 200
    with pytest.raises(qg.QuantemError):
        browse.serve(ds, port=port)  # in use
    s.stop()
    assert s.stopped
    s.stop()  # again: nothing happens
    assert repr(s) == "BrowseServer(stopped)"
    assert "<iframe" not in s._repr_html_()
    with pytest.raises(urllib.error.URLError):
        OPENER.open(base(s) + "/api/v1/capabilities", timeout=5)
    assert_port_free(port)
    again = browse.serve(ds, port=port, token=TOKEN)
    try:
        assert again.port == port
        assert request(again, "/api/v1/capabilities").status == 200
    finally:
        again.stop()


def test_wait_returns_when_stopped(ds):
    with browse.serve(ds) as s:
        t0 = time.monotonic()
        assert s.wait(timeout=0.2) is False
        assert time.monotonic() - t0 >= 0.2
        threading.Timer(0.2, s.stop).start()
        assert s.wait(timeout=30) is True
        assert s.stopped
        with pytest.raises(qg.ArgumentTypeError):
            s.wait(timeout="1")


def test_ctrl_c_in_wait_stops_the_service(ds):
    s = browse.serve(ds)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    # A bound on the wait, so a Ctrl-C that never arrives fails here instead of hanging the
    # suite (once, in a full `make test`, this wait did not return).
    with pytest.raises(KeyboardInterrupt):
        s.wait(timeout=60)
    assert s.stopped
    assert_port_free(s.port)


def test_the_with_block_stops(ds):
    with browse.serve(ds) as s:
        port = s.port
    assert s.stopped
    assert_port_free(port)


def test_dropping_the_handle_stops(ds):
    import gc

    s = browse.serve(ds)
    port = s.port
    del s
    gc.collect()
    assert_port_free(port)


def test_token_disabled_on_loopback(ds):
    with browse.serve(ds, token=False) as s:
        assert s.token is None
        assert "token=" not in s.url
        assert request(s, "/api/v1/capabilities", token=None).status == 200


def test_non_loopback_host_with_token_disabled_is_refused(ds):
    with pytest.raises(qg.InvalidArgumentError, match="token"):
        browse.serve(ds, host="0.0.0.0", token=False)


# ----------------------------------------------------------------------------- arguments


def check(err, *words):
    msg = str(err.value)
    for w in words:
        assert w in msg, (w, msg)
    assert "expected" in msg and "found" in msg, msg


def test_argument_types_are_strict(ds):
    with pytest.raises(qg.ArgumentTypeError) as e:
        browse.serve(ds, port="8000")
    check(e, "port", "'8000'")
    with pytest.raises(qg.ArgumentTypeError) as e:
        browse.serve(ds, port=8000.0)
    check(e, "port")
    with pytest.raises(qg.ArgumentTypeError) as e:
        browse.serve(3)
    check(e, "source")
    with pytest.raises(qg.ArgumentTypeError) as e:
        browse.serve(ds, token=123)
    check(e, "token")
    with pytest.raises(qg.ArgumentTypeError) as e:
        browse.serve(ds, open_browser="yes")
    check(e, "open_browser")
    with pytest.raises(qg.ArgumentTypeError) as e:
        browse.serve(ds, host=127)
    check(e, "host")


def test_argument_values_are_checked(ds, data):
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(ds, port=70000)
    check(e, "port", "70000")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(ds, port=-1)
    check(e, "port")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(data["master"], backend="gpu")
    check(e, "backend", "'gpu'")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(ds, token="has space")
    check(e, "token")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(data["master"], representation="sparse")
    check(e, "representation")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(data["master"], memory_budget=0)
    check(e, "memory_budget")


def test_a_dataset_takes_no_loading_options(ds):
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(ds, representation="dense")
    check(e, "representation")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(ds, memory_budget=1 << 30)
    check(e, "memory_budget")
    with pytest.raises(qg.InvalidArgumentError) as e:
        browse.serve(ds, backend="cuda")
    check(e, "backend")


def test_a_closed_dataset_is_refused(data):
    d = io.load(data["counts"], backend="cpu")
    d.close()
    with pytest.raises(qg.InvalidArgumentError, match="closed"):
        browse.serve(d)


def test_a_missing_path_is_refused(tmp_path):
    with pytest.raises(qg.QuantemError):
        browse.serve(tmp_path / "missing_master.h5", backend="cpu")
