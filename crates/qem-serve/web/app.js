// quantem.gpu browse page: a thin client of the HTTP API in docs/browse.md (vanilla JS, no build step,
// nothing loaded from elsewhere).
//
// Sections: 1 API access · 2 display mapping and colour maps · 3 image views · 4 request coalescing
// · 5 detector overlay · 6 scan overlay · 7 acquisition, diffraction and virtual panels · 8 SSB
// · 9 start-up and the test hook.
//
// Test hook (stable; tests/python/test_browse_page.py relies on it): window.qemBrowse =
//   { version: 1,
//     ready,        // Promise: resolves when the first acquisition's DP and virtual image are shown,
//                   //   rejects with the error text when start-up fails
//     idle(),       // Promise: resolves when no request is in flight or pending and all is drawn
//     state,        // the page state (section 7), geometry in unbinned detector edge coordinates
//     lastArrays,   // {dp, virtual, frame, ssb}: the arrays last shown ({url, shape, dtype, divisor,
//                   //   detBin, scanBin, values: Float64Array, already divided by the divisor})
//     views,        // {dp, virtual, ssb}: each .display = {lo, hi, offset, transform, gamma, cmap, plo, phi}
//     mapIndex(values, settings) }  // the display mapping below, as the page computes it
// and each image canvas (#view-dp, #view-virtual, #view-ssb) carries data-url (the array's address
// relative to the page, "api/v1/…", without the token),
// data-shape, data-lo, data-hi, data-offset, data-transform, data-gamma, data-cmap.
//
// Display mapping (exact; a test recomputes it from the API's array):
//   v      = the array as numbers (a mean is the body divided by X-Divisor, in float64)
//   v'     = v                      (linear, gamma)
//          = ln(1 + v − offset)     (log; offset = the minimum finite v)
//   lo, hi = percentiles plo, phi of the finite v': the sorted finite values s[k] with
//            k = floor(p/100 · (n − 1) + 0.5) (nearest rank; plo = 0, phi = 100 is min/max)
//   t      = clamp((v' − lo) / (hi − lo), 0, 1), 0 when hi ≤ lo or v is not finite; gamma: t = t^γ
//   index  = round(255 · t) = floor(255 · t + 0.5); gray shows (index, index, index, 255), a colour map
//            LUT[index] (256 entries interpolated linearly between 17 anchor colours).
"use strict";

// ---------------------------------------------------------------------------------------------
// 1. API access. The token comes from ?token= (the page is served with it); every request sends it
// as a Bearer header. Paths are relative so that the page also works behind a path prefix.
// ---------------------------------------------------------------------------------------------
const TOKEN = new URLSearchParams(location.search).get("token");
const API = "api/v1/";

/** An API error: the server's {error: {kind, message}} or the HTTP status. */
class ApiError extends Error {
  constructor(status, kind, message) {
    super(`${kind} (${status}): ${message}`);
    this.status = status;
    this.kind = kind;
  }
}

async function apiFetch(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  if (TOKEN) headers.Authorization = `Bearer ${TOKEN}`;
  if (body instanceof Uint8Array) headers["Content-Type"] = "application/octet-stream";
  else if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(body);
  }
  const res = await fetch(API + path, { method, headers, body, signal });
  if (!res.ok) {
    let kind = "http", message = res.statusText;
    try {
      const e = (await res.json()).error;
      if (e) ({ kind, message } = e);
    } catch (_) { /* not JSON: keep the status text */ }
    throw new ApiError(res.status, kind, message);
  }
  return res;
}

const apiJson = async (path, opts) => (await apiFetch(path, opts)).json();

const TYPED = { uint8: Uint8Array, uint16: Uint16Array, uint32: Uint32Array, uint64: BigUint64Array,
  float32: Float32Array, float64: Float64Array };

/** Fetches an array route and decodes the raw little-endian body with its X-* headers. Typed arrays
 * use the platform's byte order, which is little-endian on every platform browsers run on. uint64
 * values become Numbers (exact below 2^53, far above any count sum here). */
async function apiArray(path, signal) {
  const res = await apiFetch(path, { signal });
  const h = (k) => res.headers.get(k);
  const shape = (h("X-Shape") || "").split(",").filter((s) => s !== "").map(Number);
  const dtype = h("X-Dtype");
  if (!TYPED[dtype]) throw new ApiError(res.status, "client", `unknown X-Dtype ${dtype} for ${path}`);
  const raw = new TYPED[dtype](await res.arrayBuffer());
  if (shape.length !== 2 || raw.length !== shape[0] * shape[1]) {
    throw new ApiError(res.status, "client", `X-Shape ${h("X-Shape")} does not match ${raw.length} ${dtype} values`);
  }
  const divisor = h("X-Divisor") ? Number(h("X-Divisor")) : null;
  const values = new Float64Array(raw.length);
  for (let i = 0; i < raw.length; i++) values[i] = divisor ? Number(raw[i]) / divisor : Number(raw[i]);
  return { url: API + path, path, shape, dtype, divisor, values,
    detBin: h("X-Det-Bin") ? Number(h("X-Det-Bin")) : null,
    scanBin: h("X-Scan-Bin") ? Number(h("X-Scan-Bin")) : null,
    elapsedMs: h("X-Elapsed-Ms") ? Number(h("X-Elapsed-Ms")) : null };
}

/** Builds "route?k=v&…", leaving out undefined/null values. */
function query(route, params) {
  const q = Object.entries(params).filter(([, v]) => v !== undefined && v !== null)
    .map(([k, v]) => `${k}=${encodeURIComponent(v)}`).join("&");
  return q ? `${route}?${q}` : route;
}

/** Saves a Blob under a file name (a temporary link with the download attribute). */
function saveBlob(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

// The status line: errors stay until the next message; nothing fails silently.
const statusEl = document.getElementById("status");
function setStatus(text, kind = "info") {
  statusEl.textContent = text;
  statusEl.dataset.kind = kind;
}
function showError(what, err) {
  setStatus(`${what}: ${err && err.message ? err.message : err}`, "error");
  console.error(what, err);
}
window.addEventListener("error", (e) => showError("page error", e.message));
window.addEventListener("unhandledrejection", (e) => showError("page error", e.reason));

// ---------------------------------------------------------------------------------------------
// 2. Display mapping and colour maps (the exact rule is in the header comment).
// ---------------------------------------------------------------------------------------------

// Anchor colours at 17 equally spaced positions of the published viridis, magma and inferno maps
// (sRGB, hex); the 256-entry tables are linear interpolations between them.
const ANCHORS = {
  viridis: "440154 48186a 472d7b 424086 3b528b 33638d 2c728e 26828e 21918c 1f9f88 27ad81 3dbc74 5cc863 81d34d aadc32 d5e21a fde725",
  magma: "000004 0a0822 1d1147 36106b 51127c 6a1c81 832681 9c2e7f b73779 cf4070 e55064 f4695c fb8761 fea571 fec287 fde0a1 fcfdbf",
  inferno: "000004 0b0724 210c4a 3d0965 57106e 71196e 8a226a a32c61 bc3754 d04545 e35933 f1711f f98c0a fcaa0f f9c932 f2e865 fcffa4",
};

/** 256 × RGBA lookup tables, built once. */
const LUTS = (() => {
  const luts = { gray: new Uint8ClampedArray(1024) };
  for (let i = 0; i < 256; i++) luts.gray.set([i, i, i, 255], 4 * i);
  for (const [name, hex] of Object.entries(ANCHORS)) {
    const pts = hex.split(" ").map((h) => [0, 2, 4].map((o) => parseInt(h.slice(o, o + 2), 16)));
    const lut = new Uint8ClampedArray(1024);
    for (let i = 0; i < 256; i++) {
      const x = (i / 255) * (pts.length - 1);
      const k = Math.min(Math.floor(x), pts.length - 2), f = x - k;
      for (let ch = 0; ch < 3; ch++) lut[4 * i + ch] = Math.round(pts[k][ch] * (1 - f) + pts[k + 1][ch] * f);
      lut[4 * i + 3] = 255;
    }
    luts[name] = lut;
  }
  return luts;
})();

/** The display mapping: values → LUT indices (Uint8Array) and the numbers it used. */
function mapIndex(values, s) {
  let offset = Infinity;
  if (s.transform === "log") for (const v of values) if (Number.isFinite(v) && v < offset) offset = v;
  if (!Number.isFinite(offset)) offset = 0;
  const tv = new Float64Array(values.length);
  const finite = [];
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    tv[i] = s.transform === "log" ? Math.log1p(v - offset) : v;
    if (Number.isFinite(tv[i])) finite.push(tv[i]);
  }
  const sorted = Float64Array.from(finite).sort();
  const pct = (p) => sorted.length ? sorted[Math.floor((p / 100) * (sorted.length - 1) + 0.5)] : 0;
  const lo = pct(s.plo), hi = pct(s.phi);
  const index = new Uint8Array(values.length);
  if (hi > lo) {
    const gamma = s.transform === "gamma" ? s.gamma : 1;
    for (let i = 0; i < tv.length; i++) {
      if (!Number.isFinite(tv[i])) continue;
      let t = Math.min(1, Math.max(0, (tv[i] - lo) / (hi - lo)));
      if (gamma !== 1) t = Math.pow(t, gamma);
      index[i] = Math.floor(255 * t + 0.5);
    }
  }
  return { index, lo, hi, offset };
}

/** The data value shown at colour-bar fraction f ∈ [0, 1] (the mapping's inverse). */
function valueAt(d, f) {
  const g = d.transform === "gamma" ? Math.pow(f, 1 / d.gamma) : f;
  const t = d.lo + (d.hi - d.lo) * g;
  return d.transform === "log" ? Math.expm1(t) + d.offset : t;
}

/** Short number formatting for labels. */
function fmt(v) {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(4))); // 4 significant digits, no exponent below 1e5
}

// ---------------------------------------------------------------------------------------------
// 3. Image views: a native-resolution canvas scaled by CSS, an SVG overlay whose user units are
// the array's pixels (pixel (i, j) covers x ∈ [j, j+1), y ∈ [i, i+1)), a colour bar, the display
// settings, a value readout and PNG/.npy downloads.
// ---------------------------------------------------------------------------------------------
const SVG_NS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs = {}, parent = null) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.append(e);
  return e;
}

/** CSS size of a view's image: arrays up to STAGE_PX are magnified by a whole factor to fit it; larger
 * ones are shown 1:1 up to MAX_STAGE_PX (so a 512² scan keeps every row), beyond that scaled down. */
const STAGE_PX = 384, MAX_STAGE_PX = 768;
function magnification(n) {
  if (n <= STAGE_PX) return Math.floor(STAGE_PX / n);
  return n <= MAX_STAGE_PX ? 1 : MAX_STAGE_PX / n;
}

class ImageView {
  constructor(container, name, defaults = {}) {
    this.name = name;
    this.container = container;
    container.append(document.getElementById("view-template").content.cloneNode(true));
    const q = (sel) => container.querySelector(sel);
    this.caption = q(".caption");
    this.stage = q(".stage");
    this.canvas = q("canvas.image");
    this.canvas.id = `view-${name}`;
    this.svg = q("svg.overlay");
    this.layer = svgEl("g", { class: "shapes" }, this.svg); // drawn by the panel that owns the view
    this.scaleLayer = svgEl("g", { class: "scalebar" }, this.svg);
    this.bar = q(".colorbar canvas");
    this.ticks = [...container.querySelectorAll(".ticks span")];
    this.readout = q(".readout");
    this.inputs = { plo: q(".plo"), phi: q(".phi"), transform: q(".transform"), gamma: q(".gamma"), cmap: q(".cmap") };
    for (const [k, v] of Object.entries(defaults)) this.inputs[k].value = v;
    this.inputs.gamma.hidden = this.inputs.transform.value !== "gamma";
    for (const el of Object.values(this.inputs)) {
      el.addEventListener("change", () => {
        this.inputs.gamma.hidden = this.inputs.transform.value !== "gamma";
        this.render();
      });
    }
    q(".save-png").addEventListener("click", () => this.savePng());
    q(".save-npy").addEventListener("click", () => this.saveNpy().catch((e) => showError(`${name} .npy`, e)));
    this.svg.addEventListener("pointermove", (e) => this.showValue(e)); // the overlay covers the canvas
    this.array = null;
    this.display = null;
    this.scale = null; // {perPx, unit}
    this.lastPointer = null;
  }

  settings() {
    const i = this.inputs;
    const num = (el, d) => (Number.isFinite(parseFloat(el.value)) ? parseFloat(el.value) : d);
    return { plo: num(i.plo, 0), phi: num(i.phi, 100), transform: i.transform.value,
      gamma: num(i.gamma, 1), cmap: i.cmap.value };
  }

  /** Shows an array (see apiArray) with a caption. */
  show(array, caption) {
    this.array = array;
    delete this.container.dataset.empty;
    this.caption.textContent = `${caption} · ${array.shape.join("×")} ${array.dtype}` +
      (array.divisor ? ` ÷ ${array.divisor}` : "");
    this.render();
  }

  clear(caption) {
    this.array = null;
    this.container.dataset.empty = "";
    this.caption.textContent = caption;
    this.canvas.width = this.canvas.height = 0;
    delete this.canvas.dataset.url;
  }

  render() {
    if (!this.array) return;
    const [rows, cols] = this.array.shape;
    const s = this.settings();
    const m = mapIndex(this.array.values, s);
    this.display = { ...s, lo: m.lo, hi: m.hi, offset: m.offset };
    if (this.canvas.width !== cols || this.canvas.height !== rows) {
      this.canvas.width = cols;
      this.canvas.height = rows;
      const k = magnification(Math.max(rows, cols));
      this.stage.style.width = `${cols * k}px`;
      this.stage.style.height = `${rows * k}px`;
      this.svg.setAttribute("viewBox", `0 0 ${cols} ${rows}`);
    }
    const lut = LUTS[s.cmap] || LUTS.gray;
    const img = new ImageData(cols, rows);
    const px = img.data;
    for (let i = 0; i < m.index.length; i++) {
      const k = 4 * m.index[i];
      px[4 * i] = lut[k];
      px[4 * i + 1] = lut[k + 1];
      px[4 * i + 2] = lut[k + 2];
      px[4 * i + 3] = 255;
    }
    this.canvas.getContext("2d").putImageData(img, 0, 0);
    const bar = new ImageData(256, 1);
    bar.data.set(lut);
    this.bar.getContext("2d").putImageData(bar, 0, 0);
    this.ticks.forEach((el, k) => { el.textContent = fmt(valueAt(this.display, k / 2)); });
    const ds = this.canvas.dataset;
    Object.assign(ds, { url: this.array.url, shape: this.array.shape.join(","), lo: m.lo, hi: m.hi,
      offset: m.offset, transform: s.transform, gamma: s.gamma, cmap: s.cmap, plo: s.plo, phi: s.phi });
    this.drawScale();
    if (this.lastPointer) this.showValue(this.lastPointer);
  }

  /** A scale bar (1, 2 or 5 × 10^k units, about a fifth of the width) when calibrated. */
  setScale(perPx, unit) {
    this.scale = perPx > 0 && Number.isFinite(perPx) ? { perPx, unit } : null;
    this.drawScale();
  }

  drawScale() {
    this.scaleLayer.replaceChildren();
    if (!this.scale || !this.array) return;
    const [rows, cols] = this.array.shape;
    const want = (cols / 5) * this.scale.perPx;
    const p = Math.pow(10, Math.floor(Math.log10(want)));
    const len = [5, 2, 1].map((m) => m * p).find((v) => v <= want) || p;
    const w = len / this.scale.perPx, x = cols * 0.05, y = rows * 0.94, fs = Math.max(rows, cols) * 0.045;
    svgEl("line", { x1: x, y1: y, x2: x + w, y2: y, class: "scale-line" }, this.scaleLayer);
    const t = svgEl("text", { x, y: y - fs * 0.5, "font-size": fs, class: "scale-text" }, this.scaleLayer);
    t.textContent = `${fmt(len)} ${this.scale.unit}`;
  }

  /** Pointer position in array pixel units (x → col, y → row), continuous. */
  toPixel(e) {
    const r = this.svg.getBoundingClientRect();
    const [rows, cols] = this.array ? this.array.shape : [1, 1];
    return { row: ((e.clientY - r.top) / r.height) * rows, col: ((e.clientX - r.left) / r.width) * cols };
  }

  showValue(e) {
    this.lastPointer = { clientX: e.clientX, clientY: e.clientY }; // to refresh on the next render
    if (!this.array) return;
    const p = this.toPixel(e), [rows, cols] = this.array.shape;
    const i = Math.floor(p.row), j = Math.floor(p.col);
    if (i < 0 || j < 0 || i >= rows || j >= cols) return;
    this.readout.textContent = `(${i}, ${j}) = ${fmt(this.array.values[i * cols + j])}` +
      (this.display ? ` · lo ${fmt(this.display.lo)} hi ${fmt(this.display.hi)}` : "");
  }

  fileName(ext) {
    const base = (this.array.path.split("/").slice(1).join("_") || this.name).replace(/[^\w.=-]+/g, "_");
    return `${base.slice(0, 120)}.${ext}`;
  }

  savePng() {
    if (!this.array) return setStatus(`${this.name}: nothing to save`, "error");
    this.canvas.toBlob((b) => (b ? saveBlob(b, this.fileName("png")) : showError("PNG", "the canvas gave no image")), "image/png");
  }

  async saveNpy() {
    if (!this.array) return setStatus(`${this.name}: nothing to save`, "error");
    const url = this.array.path + (this.array.path.includes("?") ? "&" : "?") + "format=npy";
    saveBlob(await (await apiFetch(url)).blob(), this.fileName("npy"));
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Request coalescing. One channel per panel: at most one request in flight; a newer request
// replaces the pending one (never sent). During a drag the in-flight request is left to finish,
// so the image keeps updating even when each request takes longer than a mouse event; a discrete
// change (new mode, det_bin, acquisition) is "urgent" and aborts the in-flight one with its
// AbortController, since its answer would be of no use (the server drops it if still queued).
// ---------------------------------------------------------------------------------------------
const channels = [];
let idleWaiters = [];

function notifyIdle() {
  if (channels.some((c) => c.busy())) return;
  const w = idleWaiters;
  idleWaiters = [];
  w.forEach((f) => f());
}

class Channel {
  constructor(name) {
    this.name = name;
    this.pending = null;
    this.inflight = null;
    channels.push(this);
  }
  busy() { return Boolean(this.pending || this.inflight); }

  /** fn(signal) → Promise<result>; apply(result) runs only for answers that were not aborted. */
  run(fn, apply, urgent = false) {
    this.pending = { fn, apply };
    if (urgent && this.inflight) this.inflight.abort();
    this.pump();
  }

  cancel() {
    this.pending = null;
    if (this.inflight) this.inflight.abort();
  }

  async pump() {
    if (this.inflight || !this.pending) return;
    const { fn, apply } = this.pending;
    this.pending = null;
    const ctrl = new AbortController();
    this.inflight = ctrl;
    try {
      const result = await fn(ctrl.signal);
      if (!ctrl.signal.aborted) apply(result);
    } catch (e) {
      if (e.name !== "AbortError" && !ctrl.signal.aborted) showError(this.name, e);
    } finally {
      this.inflight = null;
      if (this.pending) this.pump();
      else notifyIdle();
    }
  }
}

const dpChannel = new Channel("diffraction");
const virtualChannel = new Channel("virtual image");
const ssbChannel = new Channel("SSB");
const idle = () => new Promise((resolve) => { idleWaiters.push(resolve); notifyIdle(); });

// ---------------------------------------------------------------------------------------------
// 5. The virtual detector, drawn over the diffraction view. Geometry is kept in *unbinned detector
// edge coordinates* (pixel (i, j) covers [i, i+1) × [j, j+1), so a pixel centre is at i + 0.5).
// At det_bin b the overlay's user units are binned pixels: svg = edge / b. The API takes pixel-centre
// coordinates of the viewed (binned) detector: api = edge / b − 0.5 (lengths / b).
// ---------------------------------------------------------------------------------------------

/** Radii of the named detectors in units of the BF radius (docs/science.md); Infinity: to the edge. */
const NAMED = { bf: [0, 1], abf: [0.5, 1], adf: [1, 2], haadf: [2, 4], df: [1, Infinity] };
const isNamed = (mode) => mode in NAMED;
const usesDetector = (mode) => isNamed(mode) || mode === "custom";
const round2 = (v) => Math.round(v * 100) / 100;

/** The detector in view (svg) units, for the current mode. */
function detectorInView() {
  const b = state.detBin, st = state;
  if (isNamed(st.mode)) {
    const n = st.named, [k0, k1] = NAMED[st.mode];
    return { kind: "named", row: n.row / b, col: n.col / b, radius: n.radius / b,
      inner: (k0 * n.radius) / b, outer: (k1 * n.radius) / b };
  }
  const s = st.shape;
  if (s.kind === "rect") return { kind: "rect", r0: s.r0 / b, r1: s.r1 / b, c0: s.c0 / b, c1: s.c1 / b };
  return { kind: s.kind, row: s.row / b, col: s.col / b, radius: s.radius / b, inner: s.inner / b, outer: s.outer / b };
}

/** Query parameters of the virtual image for the current mode and geometry. */
function virtualParams() {
  const st = state, b = st.detBin, p = { mode: st.mode, det_bin: b, scan_bin: st.scanBin };
  if (isNamed(st.mode)) {
    const n = st.named; // the server's own fitted disk unless the user moved it
    if (st.namedMoved) Object.assign(p, { cr: round2(n.row / b - 0.5), cc: round2(n.col / b - 0.5), radius: round2(n.radius / b) });
  } else if (st.mode === "custom") {
    const s = st.shape;
    p.mode = s.kind;
    const api = (edge) => round2(edge / b - 0.5);
    if (s.kind === "rect") { // corners may cross during a drag
      Object.assign(p, { r0: api(Math.min(s.r0, s.r1)), r1: api(Math.max(s.r0, s.r1)),
        c0: api(Math.min(s.c0, s.c1)), c1: api(Math.max(s.c0, s.c1)) });
    }
    else Object.assign(p, { cr: api(s.row), cc: api(s.col) });
    if (s.kind === "disk") p.radius = round2(s.radius / b);
    if (s.kind === "annulus") Object.assign(p, { inner: round2(s.inner / b), outer: round2(s.outer / b) });
  } else {
    p.det_bin = 1; // CoM and DPC are computed at det_bin 1 (docs/browse.md)
  }
  return p;
}

/** Redraws the detector overlay. Handles carry data-drag (what a drag on them changes). */
function drawDetector() {
  const g = views.dp.layer;
  g.replaceChildren();
  if (!state.acq || !views.dp.array || !usesDetector(state.mode)) return;
  const d = detectorInView(), [rows, cols] = views.dp.array.shape;
  const hs = Math.max(rows, cols) * 0.025; // handle size, in view pixels
  const handle = (x, y, what) =>
    svgEl("rect", { x: x - hs, y: y - hs, width: 2 * hs, height: 2 * hs, class: "handle", "data-drag": what }, g);
  if (d.kind === "rect") {
    const r0 = Math.min(d.r0, d.r1), r1 = Math.max(d.r0, d.r1), c0 = Math.min(d.c0, d.c1), c1 = Math.max(d.c0, d.c1);
    svgEl("rect", { x: c0, y: r0, width: c1 - c0, height: r1 - r0, class: "det", "data-drag": "move" }, g);
    [["r0", "c0"], ["r0", "c1"], ["r1", "c0"], ["r1", "c1"]].forEach(([r, c]) => handle(d[c], d[r], `corner:${r},${c}`));
    return;
  }
  // Disks and annuli as one even-odd path: the selected region is filled, the rest left clear.
  const circle = (r) => `M ${d.col - r} ${d.row} a ${r} ${r} 0 1 0 ${2 * r} 0 a ${r} ${r} 0 1 0 ${-2 * r} 0 Z`;
  const outer = d.kind === "disk" ? d.radius : d.outer, inner = d.kind === "disk" ? 0 : d.inner;
  let path = Number.isFinite(outer) ? circle(outer) : `M -1 -1 H ${cols + 1} V ${rows + 1} H -1 Z`;
  if (inner > 0) path += " " + circle(inner);
  svgEl("path", { d: path, class: "det", "fill-rule": "evenodd", "data-drag": "move" }, g);
  svgEl("circle", { cx: d.col, cy: d.row, r: hs * 0.6, class: "centre", "data-drag": "move" }, g);
  // Radius handles sit right of the centre, or left of it when that would leave the image.
  const side = (r) => (d.col + r + hs <= cols || d.col - r - hs < 0 ? d.col + r : d.col - r);
  if (d.kind === "named" || d.kind === "disk") handle(side(d.radius), d.row, "radius");
  else { handle(side(d.inner), d.row, "inner"); handle(side(d.outer), d.row, "outer"); }
}

/** Drags on the detector overlay: move the whole detector, or resize with a handle. The virtual
 * image follows live through the coalescing channel. */
function setupDetectorDrag() {
  const svg = views.dp.svg;
  let drag = null;
  svg.addEventListener("pointerdown", (e) => {
    const what = e.target.dataset && e.target.dataset.drag;
    if (!what || !views.dp.array) return;
    e.preventDefault();
    svg.setPointerCapture(e.pointerId);
    const geom = isNamed(state.mode) ? state.named : state.shape;
    drag = { what, geom, start: { ...geom }, p0: views.dp.toPixel(e) };
  });
  svg.addEventListener("pointermove", (e) => {
    if (!drag) return;
    const b = state.detBin, p = views.dp.toPixel(e);
    const dr = (p.row - drag.p0.row) * b, dc = (p.col - drag.p0.col) * b, g = drag.geom, s = drag.start;
    const dist = () => Math.hypot(p.row * b - g.row, p.col * b - g.col);
    if (drag.what === "move" && g.kind === "rect") {
      // Rectangles move by whole binned pixels so that their edges stay on pixel boundaries.
      const sr = Math.round(dr / b) * b, sc = Math.round(dc / b) * b;
      Object.assign(g, { r0: s.r0 + sr, r1: s.r1 + sr, c0: s.c0 + sc, c1: s.c1 + sc });
    } else if (drag.what === "move") {
      Object.assign(g, { row: round2(s.row + dr), col: round2(s.col + dc) });
    } else if (drag.what === "radius") {
      g.radius = round2(Math.max(0.5, dist()));
    } else if (drag.what === "inner") {
      g.inner = round2(Math.min(Math.max(0, dist()), g.outer - 0.5));
    } else if (drag.what === "outer") {
      g.outer = round2(Math.max(dist(), g.inner + 0.5));
    } else if (drag.what.startsWith("corner:")) {
      const [r, c] = drag.what.slice(7).split(",");
      g[r] = Math.round(p.row) * b;
      g[c] = Math.round(p.col) * b;
    }
    if (isNamed(state.mode)) state.namedMoved = true;
    drawDetector();
    requestVirtual();
  });
  const end = () => {
    if (!drag) return;
    const g = drag.geom;
    if (g.kind === "rect") { // keep r0 < r1, c0 < c1 and at least one binned pixel
      [g.r0, g.r1] = [Math.min(g.r0, g.r1), Math.max(g.r0, g.r1, Math.min(g.r0, g.r1) + state.detBin)];
      [g.c0, g.c1] = [Math.min(g.c0, g.c1), Math.max(g.c0, g.c1, Math.min(g.c0, g.c1) + state.detBin)];
      drawDetector();
      requestVirtual();
    }
    drag = null;
  };
  svg.addEventListener("pointerup", end);
  svg.addEventListener("pointercancel", end);
}

// ---------------------------------------------------------------------------------------------
// 6. The scan overlay on the virtual image: hovering shows the frame under the mouse, a click pins
// it, a shift-drag (or the ROI tool) draws a scan rectangle whose DP is shown. Positions are in
// unbinned scan pixels; at scan_bin s one image pixel is an s × s block, whose DP (the roi-dp sum
// or mean over the block) is shown instead of one frame.
// ---------------------------------------------------------------------------------------------
function drawScanMarks() {
  const g = views.virtual.layer, s = state.scanBin;
  g.replaceChildren();
  if (!views.virtual.array) return;
  if (state.roi) {
    const r = state.roi;
    svgEl("rect", { x: r.c0 / s, y: r.r0 / s, width: (r.c1 - r.c0) / s, height: (r.r1 - r.r0) / s, class: "roi" }, g);
  }
  if (state.pos && state.dpSource === "frame") {
    svgEl("rect", { x: Math.floor(state.pos.c / s), y: Math.floor(state.pos.r / s), width: 1, height: 1,
      class: state.pinned ? "pos pinned" : "pos" }, g);
  }
}

function setupScanInteraction() {
  const svg = views.virtual.svg, view = views.virtual;
  let roiDrag = null;
  const cell = (e) => {
    const p = view.toPixel(e), [rows, cols] = view.array.shape;
    return { i: Math.min(rows - 1, Math.max(0, Math.floor(p.row))), j: Math.min(cols - 1, Math.max(0, Math.floor(p.col))) };
  };
  svg.addEventListener("pointerdown", (e) => {
    if (!view.array) return;
    if (e.shiftKey || document.getElementById("roi-tool").checked) {
      e.preventDefault();
      svg.setPointerCapture(e.pointerId);
      roiDrag = { a: cell(e), b: cell(e) };
    }
  });
  svg.addEventListener("pointermove", (e) => {
    if (!view.array) return;
    const s = state.scanBin;
    if (roiDrag) {
      roiDrag.b = cell(e);
      const { a, b } = roiDrag;
      state.roi = { r0: Math.min(a.i, b.i) * s, r1: (Math.max(a.i, b.i) + 1) * s,
        c0: Math.min(a.j, b.j) * s, c1: (Math.max(a.j, b.j) + 1) * s };
      drawScanMarks();
      return;
    }
    if (state.dpSource === "frame" && !state.pinned) {
      const { i, j } = cell(e);
      if (!state.pos || Math.floor(state.pos.r / s) !== i || Math.floor(state.pos.c / s) !== j) {
        state.pos = { r: i * s, c: j * s };
        drawScanMarks();
        requestDp();
      }
    }
  });
  svg.addEventListener("pointerup", (e) => {
    if (!view.array) return;
    if (roiDrag) {
      roiDrag = null;
      setSource("roi");
      return;
    }
    // A click pins the frame under the mouse (and shows frames); a click on the pinned one unpins.
    const { i, j } = cell(e), s = state.scanBin;
    const same = state.pos && state.pinned && Math.floor(state.pos.r / s) === i && Math.floor(state.pos.c / s) === j;
    state.pos = { r: i * s, c: j * s };
    state.pinned = !same;
    setSource("frame");
  });
}

// ---------------------------------------------------------------------------------------------
// 7. Acquisition, diffraction and virtual panels.
// ---------------------------------------------------------------------------------------------
const $ = (id) => document.getElementById(id);
const state = {
  caps: null, catalog: [], id: null, acq: null,
  detBin: 1, scanBin: 1, mode: "bf",
  dpSource: "scan", reduce: "mean", pos: null, pinned: false, roi: null,
  fitted: null,                   // the fitted BF disk {row, col, radius} (edge coordinates)
  named: null, namedMoved: false, // the named detectors' centre and BF radius (edge coordinates)
  shape: null,                    // the custom detector {kind, row, col, radius, inner, outer, r0, r1, c0, c1}
  ssb: { prepared: false, job: null, values: { C10: 0, C12: 0, phi12: 0 } }, // values: Å, Å, rad
};
const lastArrays = { dp: null, virtual: null, frame: null, ssb: null };
let views = {};

/** A calibration entry: a number, a (row, col) pair or {value, source}; null when unknown. */
const calValue = (x) => (x && typeof x === "object" && !Array.isArray(x) ? x.value : x) ?? null;
/** The column (horizontal) value of a calibration entry, for scale bars. */
const calCol = (x) => { const v = calValue(x); return Array.isArray(v) ? v[1] : v; };

async function loadCatalog() {
  state.catalog = await apiJson("acquisitions");
  const list = $("catalog-list"), select = $("catalog-select");
  list.replaceChildren();
  select.replaceChildren();
  const many = state.catalog.length > 1;
  $("catalog").hidden = !many;
  $("catalog-pick").hidden = many;
  for (const a of state.catalog) {
    const label = `${a.path || a.name}${a.shape ? ` · ${a.shape.join("×")}` : ""}`;
    const li = document.createElement("li");
    li.dataset.id = a.id;
    li.dataset.ready = a.ready;
    li.innerHTML = `<span class="dot"></span><span class="name"></span><span class="why"></span>`;
    li.querySelector(".name").textContent = label;
    li.querySelector(".why").textContent = a.ready ? (a.loaded ? "loaded" : "ready") : a.reason || "not ready";
    li.title = `${a.path || a.name}${a.ready ? "" : `\n${a.reason || "not ready"}`}`;
    li.addEventListener("click", () => (a.ready ? openAcquisition(a.id).catch((e) => showError("open", e))
      : setStatus(`${a.name} is not ready: ${a.reason || "no reason given"}`, "error")));
    list.append(li);
    const opt = new Option(`${label}${a.ready ? "" : ` (not ready: ${a.reason || "?"})`}`, a.id);
    opt.disabled = !a.ready;
    select.append(opt);
  }
  return state.catalog;
}

async function openAcquisition(id) {
  [dpChannel, virtualChannel, ssbChannel].forEach((c) => c.cancel());
  setStatus(`opening ${id}…`, "busy");
  const acq = await apiJson(`acquisitions/${encodeURIComponent(id)}`);
  Object.assign(state, { id, acq, pos: null, pinned: false, roi: null, namedMoved: false,
    ssb: { prepared: false, job: null, values: { C10: 0, C12: 0, phi12: 0 } } });
  for (const li of $("catalog-list").children) li.classList.toggle("current", li.dataset.id === id);
  $("catalog-select").value = id;
  const [, , dr, dc] = acq.shape;
  const disk = acq.disk || { row: (dr - 1) / 2, col: (dc - 1) / 2, radius: Math.min(dr, dc) / 8 };
  state.fitted = { row: disk.row + 0.5, col: disk.col + 0.5, radius: disk.radius };
  state.named = { ...state.fitted };
  resetShape($("det-shape").value);
  $("dp-source").querySelector('[value="roi"]').disabled = true;
  setSource("scan", false);
  fillProvenance();
  fillSsbDefaults();
  views.ssb.clear("prepare, then reconstruct");
  drawDetector();
  requestDp(true);
  requestVirtual(true);
  await idle();
  if (statusEl.dataset.kind !== "error") { // keep an error from the first requests visible
    setStatus(`${acq.name}: ${acq.shape.join("×")} ${acq.dtype}, ${acq.representation || ""} on ${state.caps.backend}`);
  }
}

/** The custom detector's starting geometry, from the fitted disk. */
function resetShape(kind) {
  const n = state.fitted;
  const k = kind === "fit" || kind === "named" ? "disk" : kind;
  const r = n.radius;
  state.shape = { kind: k, row: n.row, col: n.col, radius: r, inner: r, outer: 2 * r,
    r0: Math.round(n.row - r), r1: Math.round(n.row + r), c0: Math.round(n.col - r), c1: Math.round(n.col + r) };
}

function setSource(source, fetch = true) {
  state.dpSource = source;
  $("dp-source").value = source;
  if (source === "roi") $("dp-source").querySelector('[value="roi"]').disabled = false;
  drawScanMarks();
  if (fetch) requestDp(true);
}

/** The DP panel's request: the whole-scan DP, one frame (or one scan_bin block), or the scan ROI. */
function dpRequest() {
  const id = encodeURIComponent(state.id), b = state.detBin, s = state.scanBin, p = state.pos;
  if (state.dpSource === "frame" && p) {
    if (s === 1) return { path: query(`acquisitions/${id}/frame`, { r: p.r, c: p.c, det_bin: b }), caption: `frame (${p.r}, ${p.c})` };
    const box = { r0: p.r, r1: p.r + s, c0: p.c, c1: p.c + s };
    return { path: query(`acquisitions/${id}/roi-dp`, { ...box, reduce: state.reduce, det_bin: b }),
      caption: `${state.reduce} of block [${box.r0}, ${box.r1}) × [${box.c0}, ${box.c1})` };
  }
  if (state.dpSource === "roi" && state.roi) {
    const r = state.roi;
    return { path: query(`acquisitions/${id}/roi-dp`, { ...r, reduce: state.reduce, det_bin: b }),
      caption: `${state.reduce} DP of scan ROI [${r.r0}, ${r.r1}) × [${r.c0}, ${r.c1})` };
  }
  return { path: query(`acquisitions/${id}/dp`, { reduce: state.reduce, det_bin: b }), caption: `${state.reduce} DP of the scan` };
}

function requestDp(urgent = false) {
  if (!state.acq) return;
  const { path, caption } = dpRequest();
  const bin = state.detBin;
  dpChannel.run((signal) => apiArray(path, signal), (arr) => {
    lastArrays.dp = arr;
    if (path.includes("/frame?")) lastArrays.frame = arr;
    views.dp.show(arr, `${caption}, det_bin ${bin}`);
    const mrad = calCol(state.acq.calibration && state.acq.calibration.det_mrad_per_px);
    views.dp.setScale(mrad * bin, "mrad");
    drawDetector();
  }, urgent);
}

function requestVirtual(urgent = false) {
  if (!state.acq) return;
  const p = virtualParams();
  const path = query(`acquisitions/${encodeURIComponent(state.id)}/virtual`, p);
  const label = $("mode").selectedOptions[0].textContent;
  virtualChannel.run((signal) => apiArray(path, signal), (arr) => {
    lastArrays.virtual = arr;
    views.virtual.show(arr, `${label}, det_bin ${arr.detBin ?? p.det_bin}, scan_bin ${arr.scanBin ?? p.scan_bin}`);
    const step = calCol(state.acq.calibration && state.acq.calibration.scan_step_a);
    views.virtual.setScale(step * (arr.scanBin || p.scan_bin), "Å");
    drawScanMarks();
  }, urgent);
}

/** Flattens provenance-like objects into "a.b: value" lines. */
function flatten(obj, prefix = "", out = []) {
  for (const [k, v] of Object.entries(obj || {})) {
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, `${prefix}${k}.`, out);
    else out.push(`${prefix}${k}: ${Array.isArray(v) ? JSON.stringify(v) : v}`);
  }
  return out;
}

function fillProvenance() {
  const c = state.caps, a = state.acq;
  const lines = [`acquisition: ${a.name} (${a.path || a.id})`,
    `service: backend ${c.backend}, revision ${c.revision}`,
    ...(c.devices || []).map((d) => (typeof d === "object"
      ? `device ${d.name}: ${d.available === false ? "unavailable" : "available"}${d.detail ? ` (${d.detail})` : ""}`
      : `device: ${d}`)),
    ...flatten(a.calibration, "calibration."), ...flatten(a.disk, "disk."), ...flatten(a.provenance)];
  $("provenance").textContent = lines.join("\n");
}

function setupPanels() {
  views = {
    dp: new ImageView($("dp-view"), "dp", { transform: "log" }),
    virtual: new ImageView($("virtual-view"), "virtual"),
    ssb: new ImageView($("ssb-view"), "ssb"),
  };
  $("det-bin").addEventListener("change", (e) => {
    state.detBin = Number(e.target.value);
    requestDp(true);
    requestVirtual(true);
  });
  $("scan-bin").addEventListener("change", (e) => {
    state.scanBin = Number(e.target.value);
    requestVirtual(true);
    if (state.dpSource === "frame") requestDp(true);
  });
  $("dp-reduce").addEventListener("change", (e) => { state.reduce = e.target.value; requestDp(true); });
  $("dp-source").addEventListener("change", (e) => {
    state.pinned = false;
    setSource(e.target.value, e.target.value !== "frame" || Boolean(state.pos));
  });
  $("mode").addEventListener("change", (e) => {
    state.mode = e.target.value;
    if (state.mode === "custom" && $("det-shape").value === "named") $("det-shape").value = state.shape.kind;
    if (isNamed(state.mode)) $("det-shape").value = "named";
    drawDetector();
    requestVirtual(true);
  });
  $("det-shape").addEventListener("change", (e) => {
    const kind = e.target.value;
    if (kind === "named") {
      if (!isNamed(state.mode)) { state.mode = "bf"; $("mode").value = "bf"; }
      state.named = { ...state.fitted };
      state.namedMoved = false;
    } else {
      resetShape(kind);
      state.mode = "custom";
      $("mode").value = "custom";
      if (kind === "fit") e.target.value = "disk";
    }
    drawDetector();
    requestVirtual(true);
  });
  $("catalog-select").addEventListener("change", (e) => openAcquisition(e.target.value).catch((err) => showError("open", err)));
  $("catalog-refresh").addEventListener("click", async () => {
    try {
      const catalog = await loadCatalog();
      const first = catalog.find((a) => a.ready);
      const summary = `catalog: ${catalog.length} acquisition(s), ${catalog.filter((a) => a.ready).length} ready`;
      if (state.id && catalog.some((a) => a.id === state.id)) {
        $("catalog-select").value = state.id;
        setStatus(summary);
      } else if (first) {
        await openAcquisition(first.id); // nothing open yet, or it went away
      } else {
        setStatus(summary, "error");
      }
    } catch (e) {
      showError("catalog", e);
    }
  });
  setupDetectorDrag();
  setupScanInteraction();
  setupSsb();
}

// ---------------------------------------------------------------------------------------------
// 8. SSB: prepare (parameters prefilled from the calibration), reconstruct as the sliders move
// (debounced, then coalesced), and fit as a job with a progress bar.
// ---------------------------------------------------------------------------------------------
const SSB_SLIDERS = ["C10", "C12", "phi12"];

function fillSsbDefaults() {
  const cal = state.acq.calibration || {}, md = state.acq.metadata || {};
  // The scan step may be a (row, col) pair: shown as "r, c" when they differ.
  const text = (v) => (Array.isArray(v) ? (v[0] === v[1] ? String(v[0]) : v.join(", ")) : v === null ? "" : String(v));
  $("ssb-voltage").value = text(calValue(cal.voltage_kv));
  $("ssb-semiangle").value = text(calValue(cal.semiangle_mrad) ?? calValue(md.semiangle_mrad));
  $("ssb-step").value = text(calValue(cal.scan_step_a));
  SSB_SLIDERS.forEach((k) => { $(`ssb-${k}`).disabled = true; });
  showSliderValues(true);
  $("ssb-fit").disabled = true;
  $("ssb-info").textContent = "";
  $("ssb-fit-info").textContent = "";
  $("ssb-progress").hidden = true;
}

/** Shows the SSB values next to the sliders (and moves the sliders to them when fromValues). */
function showSliderValues(fromValues = false) {
  const v = state.ssb.values, shown = { C10: v.C10, C12: v.C12, phi12: (v.phi12 * 180) / Math.PI };
  for (const k of SSB_SLIDERS) {
    if (fromValues) $(`ssb-${k}`).value = shown[k];
    $(`ssb-${k}`).parentElement.querySelector("output").textContent = fmt(Number(shown[k].toFixed(1)));
  }
}

async function ssbPrepare() {
  const num = (id) => (Number.isFinite(parseFloat($(id).value)) ? parseFloat($(id).value) : undefined);
  const step = $("ssb-step").value.split(/[\s,]+/).filter(Boolean).map(Number);
  const body = { voltage_kv: num("ssb-voltage"), semiangle_mrad: num("ssb-semiangle"),
    scan_step_a: step.length === 2 ? step : step.length === 1 ? step[0] : undefined, rotation_deg: num("ssb-rotation") };
  setStatus("SSB: preparing…", "busy");
  const r = await apiJson(`acquisitions/${encodeURIComponent(state.id)}/ssb/prepare`, { method: "POST", body });
  state.ssb.prepared = true;
  $("ssb-info").textContent = `${r.n_bf_pixels} BF pixels, ${fmt(r.elapsed_ms)} ms`;
  SSB_SLIDERS.forEach((k) => { $(`ssb-${k}`).disabled = false; });
  $("ssb-fit").disabled = false;
  setStatus("SSB prepared");
  ssbReconstruct(true);
}

function ssbReconstruct(urgent = false) {
  if (!state.ssb.prepared) return;
  const part = $("ssb-part").value, v = state.ssb.values;
  // Sent with 4 decimals (a fit's values are kept exact until a slider moves).
  const params = { C10: Number(v.C10.toFixed(4)), C12: Number(v.C12.toFixed(4)), phi12: Number(v.phi12.toFixed(4)) };
  const path = query(`acquisitions/${encodeURIComponent(state.id)}/ssb/reconstruct`, { ...params, part });
  ssbChannel.run((signal) => apiArray(path, signal), (arr) => {
    lastArrays.ssb = arr;
    views.ssb.show(arr, `SSB ${part}, C10 ${fmt(v.C10)} Å, C12 ${fmt(v.C12)} Å, φ12 ${fmt((v.phi12 * 180) / Math.PI)}°`);
    const step = calCol(state.acq.calibration && state.acq.calibration.scan_step_a);
    views.ssb.setScale(step, "Å");
  }, urgent);
}

async function ssbFit() {
  const id = state.id;
  const { job } = await apiJson(`acquisitions/${encodeURIComponent(id)}/ssb/fit`, { method: "POST", body: { seed: 0 } });
  state.ssb.job = job;
  const bar = $("ssb-progress");
  bar.hidden = false;
  $("ssb-fit").disabled = true;
  setStatus(`SSB fit: job ${job} running`, "busy");
  try {
    for (;;) {
      const j = await apiJson(`jobs/${encodeURIComponent(job)}`);
      if (state.ssb.job !== job || state.id !== id) return; // superseded: another acquisition or fit
      if (j.progress) { bar.max = j.progress.total || 1; bar.value = j.progress.done || 0; }
      if (j.state === "failed") {
        const e = j.error || {};
        throw new ApiError(200, e.kind || "job", e.message || JSON.stringify(j.error));
      }
      if (j.state === "done") {
        const ab = (j.result && (j.result.aberrations || j.result)) || {};
        for (const k of SSB_SLIDERS) if (Number.isFinite(ab[k])) state.ssb.values[k] = ab[k];
        showSliderValues(true);
        $("ssb-fit-info").textContent = `fit: C10 ${fmt(ab.C10)} Å, C12 ${fmt(ab.C12)} Å, φ12 ${fmt(ab.phi12)} rad` +
          (j.result && j.result.loss !== undefined ? `, loss ${fmt(j.result.loss)}` : "") +
          (j.result && j.result.evaluations !== undefined ? `, ${j.result.evaluations} evaluations` : "");
        setStatus("SSB fit done");
        ssbReconstruct(true);
        return;
      }
      await new Promise((r) => setTimeout(r, 300));
    }
  } finally {
    $("ssb-fit").disabled = false;
  }
}

let ssbTimer = null;
function setupSsb() {
  $("ssb-prepare").addEventListener("click", () => ssbPrepare().catch((e) => showError("SSB prepare", e)));
  $("ssb-fit").addEventListener("click", () => ssbFit().catch((e) => showError("SSB fit", e)));
  $("ssb-part").addEventListener("change", () => ssbReconstruct(true));
  for (const k of SSB_SLIDERS) {
    $(`ssb-${k}`).addEventListener("input", (e) => {
      const x = Number(e.target.value);
      state.ssb.values[k] = k === "phi12" ? (x * Math.PI) / 180 : x;
      showSliderValues();
      clearTimeout(ssbTimer); // debounce: one request per pause of 40 ms, then coalesced
      ssbTimer = setTimeout(() => ssbReconstruct(), 40);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// 9. Start-up and the test hook.
// ---------------------------------------------------------------------------------------------
async function start() {
  setupPanels();
  state.caps = await apiJson("capabilities");
  if (state.caps.protocol !== "quantem-gpu-browse" || state.caps.version !== 1) {
    throw new Error(`unexpected service: ${state.caps.protocol} version ${state.caps.version}`);
  }
  const catalog = await loadCatalog();
  const first = catalog.find((a) => a.ready);
  if (!first) throw new Error(catalog.length ? "no acquisition in the catalog is ready" : "the catalog is empty");
  await openAcquisition(first.id);
  if (statusEl.dataset.kind === "error") throw new Error(statusEl.textContent);
}

const ready = start().then(
  () => { document.body.dataset.state = "ready"; },
  (e) => { document.body.dataset.state = "failed"; showError("start", e); throw e.message || String(e); });
ready.catch(() => {}); // reported in the status line; the hook's users still see the rejection

window.qemBrowse = { version: 1, ready, idle, state, lastArrays, mapIndex,
  get views() { return views; } };
