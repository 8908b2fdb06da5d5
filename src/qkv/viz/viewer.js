/* qkv attention viewer: the script inlined by qkv.viz.html. No network, no dependencies.
   The data sits in the script elements #qkv-meta (JSON) and #qkv-blob-N (base64), decoded
   per head on first use. This file must never hold a script tag or an HTML comment opener. The DOM/JS contract is in qkv/viz/html.py's docstring. */
(function () {
  "use strict";
  const META = JSON.parse(document.getElementById("qkv-meta").textContent);
  const ENTRIES = META.entries;
  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ decoding
  const F16 = new Float32Array(65536); // float16 bits -> value
  for (let h = 0; h < 65536; h++) {
    const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 31, m = h & 1023;
    F16[h] = e === 0 ? s * m * Math.pow(2, -24)
      : e === 31 ? (m ? NaN : s * Infinity) : s * (1 + m / 1024) * Math.pow(2, e - 15);
  }

  function blobBytes(id) {
    const text = atob($(id).textContent.trim());
    const out = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
    return out;
  }

  function halves(buf, offset, n) {
    const u = new Uint16Array(buf, offset, n), out = new Float32Array(n);
    for (let i = 0; i < n; i++) out[i] = F16[u[i]];
    return out;
  }

  function rowsOf(entry) { // true query indices and their positions
    if (!entry._rows) {
      const rows = new Int32Array(entry.nr), pos = new Map();
      let i = 0;
      for (const [first, count] of entry.rows) {
        for (let j = 0; j < count; j++) { rows[i] = first + j; pos.set(first + j, i); i++; }
      }
      entry._rows = rows; entry._pos = pos;
    }
    return entry._rows;
  }

  function posOf(entry, q) { rowsOf(entry); const p = entry._pos.get(q); return p === undefined ? -1 : p; }

  /** The weights of one head: every cell ("f4", "f2") or block maxima + top-k per row ("top"). */
  class Mat {
    constructor(entry, hi) {
      const info = entry.heads[hi];
      this.nr = entry.nr; this.S = entry.S; this.mode = info.mode; this.vmax = info.vmax;
      this.levels = [];
      this.signed = this.mode[0] === "s"; // a difference: signed values, pooled by largest |v|
      const buf = blobBytes(info.blob).buffer, n = this.nr * this.S;
      if (this.mode === "f4" || this.mode === "s4") { this.data = new Float32Array(buf, 0, n); this.L0 = 0; return; }
      if (this.mode === "f2" || this.mode === "s2") { this.data = halves(buf, 0, n); this.L0 = 0; return; }
      if (this.mode === "sb") {
        this.block = info.block; this.L0 = Math.round(Math.log2(info.block));
        this.levels[this.L0] = { w: info.gc, h: info.gr, a: halves(buf, 0, info.gr * info.gc) };
        return;
      }
      const k = info.k, nk = this.nr * k;
      this.k = k; this.block = info.block; this.L0 = Math.round(Math.log2(info.block));
      const Ix = info.ib === 4 ? Uint32Array : Uint16Array, nb = (nk + 2 * this.nr) * info.ib;
      this.idx = new Ix(buf, 0, nk);
      this.span = new Ix(buf, nk * info.ib, 2 * this.nr); // first, last key of nonzero weight
      this.val = halves(buf, nb, nk);
      this.levels[this.L0] = { w: info.gc, h: info.gr, a: halves(buf, nb + 2 * nk, info.gr * info.gc) };
      this.rowMin = new Float32Array(this.nr);
      for (let r = 0; r < this.nr; r++) {
        let m = Infinity;
        for (let i = r * k; i < (r + 1) * k; i++) m = Math.min(m, this.val[i]);
        this.rowMin[r] = m;
      }
    }

    /** Max-pooled level l (cells of 2^l x 2^l), built on first use from the level below. */
    level(l) {
      if (this.levels[l]) return this.levels[l];
      if (l === 0 && this.data) return (this.levels[0] = { w: this.S, h: this.nr, a: this.data });
      const p = this.level(l - 1), w = Math.ceil(p.w / 2), h = Math.ceil(p.h / 2);
      const a = new Float32Array(w * h);
      if (this.signed) { // the value of largest magnitude, its sign kept
        for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
          let best = 0;
          for (const yy of [2 * y, Math.min(2 * y + 1, p.h - 1)]) for (const xx of [2 * x, Math.min(2 * x + 1, p.w - 1)]) {
            const v = p.a[yy * p.w + xx];
            if (Math.abs(v) > Math.abs(best)) best = v;
          }
          a[y * w + x] = best;
        }
        return (this.levels[l] = { w, h, a });
      }
      for (let y = 0; y < h; y++) {
        const y0 = 2 * y * p.w, y1 = 2 * y + 1 < p.h ? y0 + p.w : y0;
        for (let x = 0; x < w; x++) {
          const x0 = 2 * x, x1 = 2 * x + 1 < p.w ? x0 + 1 : x0;
          a[y * w + x] = Math.max(p.a[y0 + x0], p.a[y0 + x1], p.a[y1 + x0], p.a[y1 + x1]);
        }
      }
      return (this.levels[l] = { w, h, a });
    }

    /** {v, exact} of row position r, key c; for a cell not stored, v is an upper bound. */
    cell(r, c) {
      if (!(r >= 0 && r < this.nr && c >= 0 && c < this.S)) return null;
      if (this.data) return { v: this.data[r * this.S + c], exact: true };
      if (this.mode === "sb") { // only each block's value of largest |v| is stored
        const g = this.levels[this.L0];
        return { v: g.a[Math.floor(r / this.block) * g.w + Math.floor(c / this.block)], exact: false };
      }
      if (c < this.span[2 * r] || c > this.span[2 * r + 1]) return { v: 0, exact: true };
      let lo = r * this.k, hi = lo + this.k - 1;
      while (lo <= hi) {
        const mid = (lo + hi) >> 1, x = this.idx[mid];
        if (x === c) return { v: this.val[mid], exact: true };
        if (x < c) lo = mid + 1; else hi = mid - 1;
      }
      const g = this.levels[this.L0], b = this.block;
      const top = g.a[Math.floor(r / b) * g.w + Math.floor(c / b)];
      if (top === 0) return { v: 0, exact: true }; // its whole block is 0
      return { v: Math.min(top, this.rowMin[r]), exact: false };
    }

    /** Whether a row in [ra, rb] may have a nonzero weight in keys [ca, cb] ("top" mode). */
    reaches(ra, rb, ca, cb) {
      for (let r = ra; r <= rb; r++) if (this.span[2 * r] <= cb && this.span[2 * r + 1] >= ca) return true;
      return false;
    }

    /** The kk largest [key, weight] of row position r, largest first. */
    rowTop(r, kk) {
      this._top = this._top || new Map();
      const key = r * 1024 + kk;
      if (this._top.has(key)) return this._top.get(key);
      let out = [];
      if (this.data) {
        const base = r * this.S;
        for (let c = 0; c < this.S; c++) {
          const v = this.data[base + c];
          if (out.length < kk || v > out[out.length - 1][1]) {
            let i = out.length < kk ? out.length : kk - 1;
            while (i > 0 && out[i - 1][1] < v) { out[i] = out[i - 1]; i--; }
            out[i] = [c, v];
          }
        }
        out.length = Math.min(out.length, kk);
      } else {
        for (let i = r * this.k; i < (r + 1) * this.k; i++) out.push([this.idx[i], this.val[i]]);
        out.sort((a, b) => b[1] - a[1]);
        out = out.slice(0, kk);
      }
      this._top.set(key, out);
      return out;
    }
  }

  const mats = new Map();
  function mat(li, hi) {
    const key = li + ":" + hi;
    if (!mats.has(key)) mats.set(key, new Mat(ENTRIES[li], hi));
    return mats.get(key);
  }

  // ------------------------------------------------------------------ colours and labels
  const LUT = new Uint8ClampedArray(256 * 3);
  (function () {
    const stops = [[232, 240, 250], [158, 202, 225], [66, 146, 198], [8, 81, 156], [8, 29, 88]];
    LUT[0] = LUT[1] = LUT[2] = 255;
    for (let i = 1; i < 256; i++) {
      const t = (i - 1) / 254 * (stops.length - 1), j = Math.min(Math.floor(t), stops.length - 2), f = t - j;
      for (let ch = 0; ch < 3; ch++) LUT[3 * i + ch] = stops[j][ch] + f * (stops[j + 1][ch] - stops[j][ch]);
    }
  })();
  const UNKNOWN = [224, 224, 224], OUTSIDE = [246, 246, 246];
  // Differences: blue for positive, red for negative, white at 0 (DLUT[255] is 0).
  const DLUT = new Uint8ClampedArray(511 * 3);
  (function () {
    const neg = [[103, 0, 13], [203, 24, 29], [251, 106, 74], [252, 187, 161], [255, 255, 255]];
    const pos = [[255, 255, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
    for (let i = 0; i < 511; i++) {
      const stops = i < 255 ? neg : pos, t = (i < 255 ? i : i - 255) / 255 * (stops.length - 1);
      const j = Math.min(Math.floor(t), stops.length - 2), f = t - j;
      for (let ch = 0; ch < 3; ch++) DLUT[3 * i + ch] = stops[j][ch] + f * (stops[j + 1][ch] - stops[j][ch]);
    }
  })();

  function shadeSigned(scale, vmax) { // difference -> DLUT index, 255 for 0
    const inv = vmax > 0 ? 1 / vmax : 1;
    return function (v) {
      if (!(v !== 0) || !Number.isFinite(v)) return 255;
      let t = Math.min(1, Math.abs(v) * inv);
      if (scale === "sqrt") t = Math.sqrt(t);
      else if (scale === "log") t = Math.max(0, (Math.log10(t) + 4) / 4);
      const n = Math.max(1, Math.round(t * 255));
      return v > 0 ? Math.min(510, 255 + n) : Math.max(0, 255 - n);
    };
  }

  function shade(scale, vmax) { // weight -> LUT index
    const inv = vmax > 0 ? 1 / vmax : 1;
    return function (v) {
      if (!(v > 0)) return 0;
      let t = v * inv;
      if (scale === "sqrt") t = Math.sqrt(t);
      else if (scale === "log") t = (Math.log10(t) + 4) / 4;
      return Math.max(1, Math.min(255, Math.round(t * 255)));
    };
  }

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf"];
  const headColour = (i) => i < PALETTE.length ? PALETTE[i] : `hsl(${(i * 137.5) % 360},65%,45%)`;

  function tokenAt(ref, i) { const list = META.tokens[ref[0]]; return list ? list[ref[1] + i] : undefined; }
  function qLabel(entry, r) { // row position r
    const q = rowsOf(entry)[r];
    return entry.qtok ? tokenAt(entry.qtok, q) : String(q);
  }
  function kLabel(entry, c) { return entry.ktok !== null && entry.ktok !== undefined ? tokenAt([entry.ktok, 0], c) : String(c); }
  const clip = (s, n) => s.length > n ? s.slice(0, n - 1) + "…" : s;
  const fmt = (v) => v.toPrecision(4);

  // ------------------------------------------------------------------ state
  const state = { layer: 0, head: "all", view: "head" };
  const VIEWS = (ENTRIES.length ? ["head", "matrix", "overview", "model"] : []).concat(
    ["explain", "scores", "saliency", "changes", "deformable"].filter((v) => $("view-" + v)));
  let zoom = null; // matrix view: {r0, r1, c0, c1} in cells
  let zoomKey = "";
  let thumbsFor = "";
  let focus = null; // head view: {q: pos} or {k: key}

  const entry = () => ENTRIES[state.layer];
  const shownHead = () => state.head === "all" ? 0 : state.head;
  const scaleName = () => $("scale").value;

  // ------------------------------------------------------------------ matrix drawing
  /** Paint the cells [r0, r1) x [c0, c1) of m onto an ImageData of W x H pixels. */
  function paint(m, W, H, view, scale) {
    if (m.signed) return paintSigned(m, W, H, view, scale);
    const img = new ImageData(W, H), px = img.data;
    const sy = (view.r1 - view.r0) / H, sx = (view.c1 - view.c0) / W;
    const per = Math.min(sx, sy);
    const idx = shade(scale, m.vmax);
    let l = per >= 2 ? Math.floor(Math.log2(per)) : 0;
    // Stored as block maxima + each row's top k: the top-k cells only while a pixel is finer
    // than a block both ways. A pixel wider (or taller) than a block, as in a head of far
    // fewer kept rows than keys, takes the block maxima, as a zoomed-out square head does;
    // from the top k alone, every pixel no row's top k fell in would be "not stored".
    const sparse = !m.data && Math.max(sx, sy) < (1 << m.L0);
    if (!m.data) l = Math.max(l, m.L0);
    const lev = m.level(l);
    const span = (a0, s, n, count) => { // per pixel: first and last cell, -1 outside
      const lo = new Int32Array(count), hi = new Int32Array(count);
      for (let p = 0; p < count; p++) {
        const a = Math.floor(a0 + p * s), b = Math.max(a, Math.ceil(a0 + (p + 1) * s) - 1);
        if (a >= n || b < 0) { lo[p] = hi[p] = -1; continue; }
        lo[p] = Math.max(a, 0); hi[p] = Math.min(b, n - 1);
      }
      return [lo, hi];
    };
    const [cl, ch] = span(view.c0, sx, m.S, W), [rl, rh] = span(view.r0, sy, m.nr, H);
    const pv = sparse ? new Float32Array(W * H).fill(-1) : null;
    if (sparse) scatter(m, W, H, view, sx, sy, pv);
    let xA = 0, xB = W - 1;
    while (xA < W && cl[xA] < 0) xA++;
    while (xB >= 0 && cl[xB] < 0) xB--;
    const bxA = xA <= xB ? cl[xA] >> l : 0, bxB = xA <= xB ? ch[xB] >> l : -1;
    const colMax = new Float32Array(Math.max(0, bxB - bxA + 1)); // this pixel row's max per block column
    let prev = -1;
    for (let y = 0; y < H; y++) {
      const row0 = 4 * y * W;
      if (rl[y] < 0 || xA > xB) {
        for (let o = row0; o < row0 + 4 * W; o += 4) { px[o] = OUTSIDE[0]; px[o + 1] = OUTSIDE[1]; px[o + 2] = OUTSIDE[2]; px[o + 3] = 255; }
        continue;
      }
      if (prev >= 0 && rl[y] === rl[prev] && rh[y] === rh[prev]) { // the same cells as the row above
        px.copyWithin(row0, 4 * prev * W, 4 * prev * W + 4 * W);
        continue;
      }
      prev = y;
      colMax.fill(0);
      for (let by = rl[y] >> l; by <= rh[y] >> l; by++) {
        const base = by * lev.w;
        for (let bx = bxA; bx <= bxB; bx++) if (lev.a[base + bx] > colMax[bx - bxA]) colMax[bx - bxA] = lev.a[base + bx];
      }
      for (let x = 0; x < W; x++) {
        const o = row0 + 4 * x;
        px[o + 3] = 255;
        if (cl[x] < 0) { px[o] = OUTSIDE[0]; px[o + 1] = OUTSIDE[1]; px[o + 2] = OUTSIDE[2]; continue; }
        let v = 0;
        for (let bx = cl[x] >> l; bx <= ch[x] >> l; bx++) if (colMax[bx - bxA] > v) v = colMax[bx - bxA];
        if (sparse) {
          const s = pv[y * W + x];
          if (s < 0 && v > 0 && m.reaches(rl[y], rh[y], cl[x], ch[x])) { px[o] = UNKNOWN[0]; px[o + 1] = UNKNOWN[1]; px[o + 2] = UNKNOWN[2]; continue; }
          v = Math.max(s, 0);
        }
        const i = 3 * idx(v);
        px[o] = LUT[i]; px[o + 1] = LUT[i + 1]; px[o + 2] = LUT[i + 2];
      }
    }
    return img;
  }

  /** A difference: each pixel shows the covered value of largest |v| on the diverging scale. */
  function paintSigned(m, W, H, view, scale) {
    const img = new ImageData(W, H), px = img.data, idx = shadeSigned(scale, m.vmax);
    const sy = (view.r1 - view.r0) / H, sx = (view.c1 - view.c0) / W, per = Math.min(sx, sy);
    const l = Math.max(m.L0, per >= 2 ? Math.floor(Math.log2(per)) : 0), lev = m.level(l);
    for (let y = 0; y < H; y++) {
      const a = Math.floor(view.r0 + y * sy), b = Math.max(a, Math.ceil(view.r0 + (y + 1) * sy) - 1);
      for (let x = 0; x < W; x++) {
        const o = 4 * (y * W + x), c0 = Math.floor(view.c0 + x * sx), c1 = Math.max(c0, Math.ceil(view.c0 + (x + 1) * sx) - 1);
        px[o + 3] = 255;
        if (a >= m.nr || b < 0 || c0 >= m.S || c1 < 0) { px[o] = OUTSIDE[0]; px[o + 1] = OUTSIDE[1]; px[o + 2] = OUTSIDE[2]; continue; }
        let v = 0;
        for (let by = Math.max(a, 0) >> l; by <= Math.min(b, m.nr - 1) >> l; by++) {
          for (let bx = Math.max(c0, 0) >> l; bx <= Math.min(c1, m.S - 1) >> l; bx++) {
            const u = lev.a[by * lev.w + bx];
            if (Math.abs(u) > Math.abs(v)) v = u;
          }
        }
        const i = 3 * idx(v);
        px[o] = DLUT[i]; px[o + 1] = DLUT[i + 1]; px[o + 2] = DLUT[i + 2];
      }
    }
    return img;
  }

  /** "top" mode zoomed in: the stored cells in view, max per pixel, into pv. */
  function scatter(m, W, H, view, sx, sy, pv) {
    const rA = Math.max(0, Math.floor(view.r0)), rB = Math.min(m.nr, Math.ceil(view.r1));
    const cA = Math.max(0, Math.floor(view.c0)), cB = Math.min(m.S, Math.ceil(view.c1));
    for (let r = rA; r < rB; r++) {
      const y0 = Math.max(0, Math.floor((r - view.r0) / sy)), y1 = Math.min(H, Math.max(y0 + 1, Math.ceil((r + 1 - view.r0) / sy)));
      for (let i = r * m.k; i < (r + 1) * m.k; i++) {
        const c = m.idx[i];
        if (c < cA || c >= cB) continue;
        const x0 = Math.max(0, Math.floor((c - view.c0) / sx)), x1 = Math.min(W, Math.max(x0 + 1, Math.ceil((c + 1 - view.c0) / sx)));
        for (let y = y0; y < y1; y++) for (let x = x0; x < x1; x++) {
          const o = y * W + x;
          if (m.val[i] > pv[o]) pv[o] = m.val[i];
        }
      }
    }
  }

  function fullView(m) { return { r0: 0, r1: m.nr, c0: 0, c1: m.S }; }

  function drawMatrix() {
    const e = entry(), hi = shownHead(), m = mat(state.layer, hi), canvas = $("matrix-canvas");
    const key = state.layer + ":" + m.nr + "x" + m.S;
    if (!zoom || zoomKey !== key) { zoom = fullView(m); zoomKey = key; }
    const ctx = canvas.getContext("2d");
    ctx.putImageData(paint(m, canvas.width, canvas.height, zoom, scaleName()), 0, 0);
    writeValues(ctx, m, canvas.width, canvas.height);
    drawAxes(e, m);
    legend(m);
    const rows = rowsOf(e);
    const rA = Math.max(0, Math.floor(zoom.r0)), rB = Math.min(m.nr, Math.ceil(zoom.r1)) - 1;
    const cA = Math.max(0, Math.floor(zoom.c0)), cB = Math.min(m.S, Math.ceil(zoom.c1)) - 1;
    const per = Math.max((zoom.r1 - zoom.r0) / canvas.height, (zoom.c1 - zoom.c0) / canvas.width);
    $("axis-info").textContent = `queries q=${rows[rA]}..${rows[rB]} (rows ${rA}..${rB} of ${m.nr}) ` +
      `↓ · keys k=${cA}..${cB} of ${m.S} → · ` +
      (per > 1 ? `each pixel: max of up to ${Math.ceil(per)}×${Math.ceil(per)} cells` : "each cell ≥ 1 pixel");
    $("matrix-note").textContent = (state.head === "all" ? "head all: showing head " + e.heads[0].head + " (pick a head). " : "") +
      (m.mode === "top" ? `cells outside each row's top ${m.k} are not stored (grey when zoomed in; hover gives a bound, w≤).` : "");
  }

  function legend(m) { // the colour ramp from 0 to the head's largest weight
    if (m.signed) {
      const stops = [];
      for (let i = 0; i <= 510; i += 51) stops.push(`rgb(${DLUT[3 * i]},${DLUT[3 * i + 1]},${DLUT[3 * i + 2]})`);
      const box = $("scale-legend"), ramp = document.createElement("i");
      ramp.style.background = `linear-gradient(to right, ${stops.join(",")})`;
      box.textContent = `−${fmt(m.vmax)}`;
      box.appendChild(ramp);
      box.appendChild(document.createTextNode(`+${fmt(m.vmax)} (difference; 0 white, head max |d|)`));
      return;
    }
    const stops = [];
    for (let i = 0; i <= 255; i += 51) stops.push(`rgb(${LUT[3 * i]},${LUT[3 * i + 1]},${LUT[3 * i + 2]})`);
    const box = $("scale-legend"), ramp = document.createElement("i");
    ramp.style.background = `linear-gradient(to right, ${stops.join(",")})`;
    box.textContent = "0";
    box.appendChild(ramp);
    box.appendChild(document.createTextNode(`${fmt(m.vmax)} (head max` +
      (scaleName() === "log" ? "; log: 1e-4·max at the light end)" : ")")));
  }

  /** Each cell's weight written in it, once cells are large enough to hold the text. */
  function writeValues(ctx, m, W, H) {
    const cw = W / (zoom.c1 - zoom.c0), ch = H / (zoom.r1 - zoom.r0);
    if (cw < 34 || ch < 14) return;
    const vmax = m.vmax > 0 ? m.vmax : 1, scale = scaleName();
    const idx = m.signed ? ((f) => (v) => Math.abs(f(v) - 255))(shadeSigned(scale, vmax)) : shade(scale, vmax);
    ctx.font = `${Math.min(12, Math.floor(ch * 0.6))}px ui-monospace, Menlo, Consolas, monospace`;
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    for (let r = Math.max(0, Math.floor(zoom.r0)); r < Math.min(m.nr, Math.ceil(zoom.r1)); r++) {
      for (let c = Math.max(0, Math.floor(zoom.c0)); c < Math.min(m.S, Math.ceil(zoom.c1)); c++) {
        const cell = m.cell(r, c);
        if (!cell.exact) continue;
        const v = cell.v, text = v === 0 ? "0" : Math.abs(v) < 0.005 ? v.toExponential(0) : v.toFixed(2);
        ctx.fillStyle = idx(v) > 150 ? "#fff" : "#1d2433";
        ctx.fillText(text, (c + 0.5 - zoom.c0) * cw, (r + 0.5 - zoom.r0) * ch);
      }
    }
  }

  /** Query labels left of the matrix, key labels above it: every one when there is room,
      else evenly spaced indices. */
  function drawAxes(e, m) {
    const rowsC = $("matrix-rows"), colsC = $("matrix-cols"), rows = rowsOf(e);
    const rc = rowsC.getContext("2d"), cc = colsC.getContext("2d");
    rc.clearRect(0, 0, rowsC.width, rowsC.height); cc.clearRect(0, 0, colsC.width, colsC.height);
    rc.font = cc.font = "11px system-ui, sans-serif";
    rc.fillStyle = cc.fillStyle = "#1d2433"; rc.textBaseline = cc.textBaseline = "middle";
    const ch = rowsC.height / (zoom.r1 - zoom.r0), cw = colsC.width / (zoom.c1 - zoom.c0);
    const every = (px) => { let s = 1; while (s * px < 16) s *= s % 3 === 1 ? 2 : 2.5; return Math.round(s); };
    const rStep = ch >= 12 ? 1 : every(ch), cStep = cw >= 12 ? 1 : every(cw);
    rc.textAlign = "right";
    for (let r = Math.ceil(Math.max(0, zoom.r0) / rStep) * rStep; r < Math.min(m.nr, zoom.r1); r += rStep) {
      const text = rStep === 1 ? clip(qLabel(e, r), 16) : String(rows[r]);
      rc.fillText(text, rowsC.width - 4, (r + 0.5 - zoom.r0) * ch);
    }
    cc.textAlign = "left";
    for (let c = Math.ceil(Math.max(0, zoom.c0) / cStep) * cStep; c < Math.min(m.S, zoom.c1); c += cStep) {
      cc.save(); cc.translate((c + 0.5 - zoom.c0) * cw, colsC.height - 4); cc.rotate(-Math.PI / 3);
      cc.fillText(cStep === 1 ? clip(kLabel(e, c), 11) : String(c), 0, 0); cc.restore();
    }
  }

  function viewCell(clientX, clientY) { // fractional cell coords under a client point, or null
    const canvas = $("matrix-canvas"), rect = canvas.getBoundingClientRect();
    if (!zoom || rect.width === 0) return null;
    const x = (clientX - rect.left) * canvas.width / rect.width, y = (clientY - rect.top) * canvas.height / rect.height;
    if (!(x >= 0 && y >= 0 && x < canvas.width && y < canvas.height)) return null;
    return { x, y, r: zoom.r0 + y * (zoom.r1 - zoom.r0) / canvas.height, c: zoom.c0 + x * (zoom.c1 - zoom.c0) / canvas.width };
  }

  function cellAt(clientX, clientY) {
    const v = viewCell(clientX, clientY), e = entry();
    if (!v) return null;
    const r = Math.floor(v.r), c = Math.floor(v.c);
    if (r < 0 || r >= e.nr || c < 0 || c >= e.S) return null;
    return { q: rowsOf(e)[r], k: c };
  }

  function cellCenter(q, k) {
    const e = entry(), r = posOf(e, q), canvas = $("matrix-canvas"), rect = canvas.getBoundingClientRect();
    if (r < 0 || !(k >= 0 && k < e.S) || !zoom) return null;
    const x = (k + 0.5 - zoom.c0) / (zoom.c1 - zoom.c0) * canvas.width;
    const y = (r + 0.5 - zoom.r0) / (zoom.r1 - zoom.r0) * canvas.height;
    if (!(x >= 0 && y >= 0 && x < canvas.width && y < canvas.height)) return null;
    return { x: rect.left + x * rect.width / canvas.width, y: rect.top + y * rect.height / canvas.height };
  }

  function value(layer, head, q, k) {
    const e = ENTRIES[+layer], hi = head === "all" ? 0 : +head;
    if (!e || !(hi >= 0 && hi < e.heads.length)) return null;
    const c = mat(+layer, hi).cell(posOf(e, q), k);
    return c ? c.v : null;
  }

  function exact(layer, head, q, k) {
    const e = ENTRIES[+layer], hi = head === "all" ? 0 : +head;
    if (!e || !(hi >= 0 && hi < e.heads.length)) return null;
    const c = mat(+layer, hi).cell(posOf(e, q), k);
    return c ? c.exact : null;
  }

  function hover(ev) {
    const tip = $("tooltip"), at = cellAt(ev.clientX, ev.clientY);
    if (!at) { tip.style.display = "none"; return; }
    const e = entry(), hi = shownHead(), c = mat(state.layer, hi).cell(posOf(e, at.q), at.k);
    const m = mat(state.layer, hi), sym = m.signed ? (c.exact ? "d=" : "d≈") : (c.exact ? "w=" : "w≤");
    tip.textContent = `q=${at.q} k=${at.k} ${sym}${fmt(c.v)}`;
    tip.style.display = "block";
    tip.style.left = (ev.clientX + 14) + "px"; tip.style.top = (ev.clientY + 14) + "px";
    const r = posOf(e, at.q);
    $("cell-info").textContent = `query ${at.q} “${clip(qLabel(e, r), 40)}” → key ${at.k} “${clip(kLabel(e, at.k), 40)}”, ` +
      `head ${e.heads[hi].head}: ${m.signed ? (c.exact ? "difference = " : "largest |difference| of its block = ") + fmt(c.v)
        : c.exact ? "w = " + fmt(c.v) : "not stored, w ≤ " + fmt(c.v)} (${PRECISION[e.heads[hi].mode]})`;
  }

  function setZoom(r0, r1, c0, c1) {
    const e = entry();
    const fit = (a, b, n) => {
      let w = Math.min(n, Math.max(b - a, Math.min(n, 2)));
      let lo = Math.max(0, Math.min(a + (b - a - w) / 2, n - w));
      return [lo, lo + w];
    };
    [r0, r1] = fit(r0, r1, e.nr); [c0, c1] = fit(c0, c1, e.S);
    zoom = { r0, r1, c0, c1 };
    drawMatrix();
  }

  function wireMatrix() {
    const canvas = $("matrix-canvas"), box = $("zoom-box");
    let drag = null;
    canvas.addEventListener("mousemove", (ev) => {
      hover(ev);
      if (!drag) return;
      const rect = canvas.getBoundingClientRect();
      const x0 = Math.min(drag.x, ev.clientX), y0 = Math.min(drag.y, ev.clientY);
      Object.assign(box.style, { display: "block", left: (x0 - rect.left) + "px", top: (y0 - rect.top) + "px",
        width: Math.abs(ev.clientX - drag.x) + "px", height: Math.abs(ev.clientY - drag.y) + "px" });
    });
    canvas.addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });
    canvas.addEventListener("mousedown", (ev) => {
      if (ev.button !== 0) return;
      ev.preventDefault();
      drag = { x: ev.clientX, y: ev.clientY, at: viewCell(ev.clientX, ev.clientY) };
    });
    window.addEventListener("mouseup", (ev) => {
      if (!drag) return;
      const start = drag; drag = null; box.style.display = "none";
      if (Math.abs(ev.clientX - start.x) < 4 || Math.abs(ev.clientY - start.y) < 4 || !start.at) return;
      const rect = canvas.getBoundingClientRect();
      const end = viewCell(Math.min(Math.max(ev.clientX, rect.left), rect.right - 0.01),
        Math.min(Math.max(ev.clientY, rect.top), rect.bottom - 0.01));
      if (!end) return;
      setZoom(Math.min(start.at.r, end.r), Math.max(start.at.r, end.r), Math.min(start.at.c, end.c), Math.max(start.at.c, end.c));
    });
    canvas.addEventListener("wheel", (ev) => {
      const at = viewCell(ev.clientX, ev.clientY);
      if (!at) return;
      ev.preventDefault();
      const f = ev.deltaY < 0 ? 0.8 : 1.25;
      setZoom(at.r - (at.r - zoom.r0) * f, at.r + (zoom.r1 - at.r) * f, at.c - (at.c - zoom.c0) * f, at.c + (zoom.c1 - at.c) * f);
      hover(ev);
    }, { passive: false });
    $("zoom-reset").addEventListener("click", () => { zoom = null; drawMatrix(); });
    $("scale").addEventListener("change", () => { thumbsFor = ""; modelFor = ""; draw(); });
  }

  // ------------------------------------------------------------------ head view
  const ROW = 18, WIN = 40, TOP = 30, QX = 300, KX = 480;
  let layout = { yq: () => -1, qs: 0, nq: 0, ks: 0, nk: 0 }; // of the last head view drawn

  function windows() {
    const e = entry(), nq = Math.min(e.nr, WIN), nk = Math.min(e.S, WIN);
    const qs = Math.min(+$("head-scroll").value, e.nr - nq);
    let ks = +$("key-scroll").value;
    if ($("follow").checked) {
      const rows = rowsOf(e), last = rows[qs + nq - 1] + (e.S >= e.T ? e.S - e.T : 0);
      ks = Math.max(0, Math.min(last - nk + 1, e.S - nk));
      $("key-scroll").value = String(ks);
    }
    ks = Math.min(ks, e.S - nk);
    return { nq, nk, qs, ks };
  }

  function drawHead() {
    const e = entry(), canvas = $("head-canvas");
    const { nq, nk, qs, ks } = windows();
    const kk = Math.max(1, Math.min(64, Math.floor(+$("topk").value) || 1));
    const thr = Math.max(0, +$("threshold").value || 0);
    const heads = state.head === "all" ? e.heads.map((_, i) => i) : [state.head];
    canvas.height = TOP * 2 + Math.max(nq, nk) * ROW;
    const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height;
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, H);
    if (e.kind === "diff") {
      $("legend").innerHTML = "";
      $("head-note").textContent = "A difference page: its heads are differences, not weights; see them in the matrix, layer overview and changes views.";
      return;
    }
    const yk = (c) => TOP + (c - ks) * ROW + ROW / 2, rows = rowsOf(e), shift = e.S >= e.T ? e.S - e.T : 0;
    // A query sits beside its own position among the keys when all shown queries fit there.
    let aligned = $("follow").checked;
    for (let p = qs; aligned && p < qs + nq; p++) aligned = rows[p] + shift >= ks && rows[p] + shift < ks + nk;
    const yq = aligned ? (p) => yk(rows[p] + shift) : (p) => TOP + (p - qs) * ROW + ROW / 2;
    layout = { yq, aligned, qs, nq, ks, nk };
    ctx.font = "12px system-ui, sans-serif"; ctx.textBaseline = "middle";
    ctx.fillStyle = "#5b6475"; ctx.textAlign = "center";
    if (ks > 0) ctx.fillText(`↑ keys 0..${ks - 1}`, KX + 40, TOP / 2);
    if (ks + nk < e.S) ctx.fillText(`↓ keys ${ks + nk}..${e.S - 1}`, KX + 40, H - TOP / 2);
    const lines = [];
    let best = 0;
    for (const hi of heads) {
      const m = mat(state.layer, hi);
      for (let p = qs; p < qs + nq; p++) {
        let above = 0, below = 0;
        for (const [c, v] of m.rowTop(p, kk)) {
          best = Math.max(best, v);
          if (v < thr || v <= 0) continue;
          if (c < ks) above += v; else if (c >= ks + nk) below += v;
          else lines.push([hi, p, yk(c), v, c]);
        }
        if (above > 0) lines.push([hi, p, TOP - 8, above, -1]);
        if (below > 0) lines.push([hi, p, H - TOP + 8, below, -2]);
      }
    }
    ctx.lineCap = "round";
    for (const [hi, p, y, v, c] of lines) {
      const on = !focus || (focus.q === p) || (focus.k !== undefined && focus.k === c);
      ctx.globalAlpha = (on ? 1 : 0.08) * Math.min(1, 0.08 + Math.sqrt(v));
      ctx.strokeStyle = headColour(hi); ctx.lineWidth = 0.6 + 3 * Math.min(1, v);
      ctx.beginPath(); ctx.moveTo(QX + 6, yq(p)); ctx.lineTo(KX - 6, y); ctx.stroke();
    }
    ctx.globalAlpha = 1;
    for (let p = qs; p < qs + nq; p++) {
      ctx.fillStyle = focus && focus.q === p ? "#c2185b" : "#1d2433"; ctx.textAlign = "right";
      ctx.fillText(clip(qLabel(e, p), 28), QX, yq(p));
      ctx.fillStyle = "#9aa1ad"; ctx.textAlign = "left"; ctx.fillText(String(rows[p]), 8, yq(p));
    }
    for (let c = ks; c < ks + nk; c++) {
      ctx.fillStyle = focus && focus.k === c ? "#c2185b" : "#1d2433"; ctx.textAlign = "left";
      ctx.fillText(clip(kLabel(e, c), 28), KX, yk(c));
      ctx.fillStyle = "#9aa1ad"; ctx.textAlign = "right"; ctx.fillText(String(c), W - 8, yk(c));
    }
    $("legend").innerHTML = "";
    for (const hi of heads) {
      const s = document.createElement("span"), i = document.createElement("i");
      i.style.background = headColour(hi); s.appendChild(i);
      s.appendChild(document.createTextNode("head " + e.heads[hi].head)); $("legend").appendChild(s);
    }
    let note = `queries ${rows[qs]}..${rows[qs + nq - 1]} of ${e.nr} kept, keys ${ks}..${ks + nk - 1} of ${e.S}; ` +
      `lines: each query's top ${kk} keys with w ≥ ${thr}` +
      (best < thr ? ` (none in view: the largest weight here is ${fmt(best)}; lower the threshold)` : "") +
      ". Hover a token to single it out; the wheel scrolls the queries.";
    if (focus && focus.q !== undefined) {
      const top = mat(state.layer, heads[0]).rowTop(focus.q, kk);
      note = `query ${rows[focus.q]} “${clip(qLabel(e, focus.q), 30)}”, head ${e.heads[heads[0]].head}: ` +
        top.map(([c, v]) => `k=${c} “${clip(kLabel(e, c), 16)}” ${fmt(v)}`).join(", ");
    }
    $("head-note").textContent = note;
  }

  function wireHead() {
    const canvas = $("head-canvas");
    for (const id of ["topk", "threshold", "head-scroll", "key-scroll", "follow"]) {
      $(id).addEventListener("input", () => { $("key-scroll").disabled = $("follow").checked; drawHead(); });
    }
    canvas.addEventListener("mousemove", (ev) => {
      const rect = canvas.getBoundingClientRect(), x = ev.clientX - rect.left, y = ev.clientY - rect.top;
      const { yq, qs, nq, ks, nk } = layout, i = Math.floor((y - TOP) / ROW);
      let f = null;
      if (x < (QX + KX) / 2) {
        for (let p = qs; p < qs + nq; p++) if (Math.abs(yq(p) - y) < ROW / 2) f = { q: p };
      } else if (i >= 0 && i < nk) f = { k: ks + i };
      if (JSON.stringify(f) !== JSON.stringify(focus)) { focus = f; drawHead(); }
    });
    canvas.addEventListener("mouseleave", () => { if (focus) { focus = null; drawHead(); } });
    canvas.addEventListener("wheel", (ev) => {
      const s = $("head-scroll"), before = +s.value;
      s.value = String(Math.max(0, Math.min(+s.max, before + Math.sign(ev.deltaY) * 3)));
      if (+s.value !== before) { ev.preventDefault(); focus = null; drawHead(); }
    }, { passive: false });
  }

  function resetHeadWindows() {
    const e = entry();
    $("head-scroll").max = String(Math.max(0, e.nr - Math.min(e.nr, WIN)));
    $("key-scroll").max = String(Math.max(0, e.S - Math.min(e.S, WIN)));
    $("head-scroll").value = "0";
    $("key-scroll").disabled = $("follow").checked;
    focus = null;
  }

  // ------------------------------------------------------------------ overview
  function drawOverview() {
    const key = state.layer + ":" + scaleName();
    if (thumbsFor === key) return;
    thumbsFor = key;
    const e = entry(), box = $("thumbs");
    box.innerHTML = "";
    e.heads.forEach((h, hi) => {
      const fig = document.createElement("figure"), c = document.createElement("canvas");
      c.className = "thumb"; c.dataset.head = String(hi); c.width = c.height = 150;
      c.title = `head ${h.head}: open in the matrix view`;
      const m = mat(state.layer, hi);
      c.getContext("2d").putImageData(paint(m, 150, 150, fullView(m), scaleName()), 0, 0);
      c.addEventListener("click", () => { setHead(hi); setView("matrix"); });
      const cap = document.createElement("figcaption");
      cap.textContent = `head ${h.head} · max ${m.signed ? "|d| " : ""}${fmt(h.vmax)}` + scoreCaption(state.layer, hi);
      if (scoreBest(state.layer, hi)) c.classList.add("best");
      fig.appendChild(c); fig.appendChild(cap); box.appendChild(fig);
    });
  }

  // ------------------------------------------------------------------ model view
  let modelFor = "";

  /** Every layer entry x head as a thumbnail (bertviz's model view), from the stored weights:
      the page holds nothing more for it. A click opens the cell in the matrix view. */
  function drawModel() {
    const key = scaleName() + ":" + (SCORES ? scoreName : "");
    if (modelFor === key) return;
    modelFor = key;
    const grid = $("model-grid"), most = Math.max(...ENTRIES.map((e) => e.heads.length));
    grid.innerHTML = "";
    // The labels first, alone, to measure their column; the thumbnails share what is left of
    // the grid's width, less room for a vertical scrollbar (12 layers scroll), gaps and borders.
    grid.style.gridTemplateColumns = "max-content";
    const labels = ENTRIES.map((e) => {
      const label = document.createElement("div");
      label.className = "mlabel"; label.textContent = e.label; grid.appendChild(label);
      return label;
    });
    const labelWidth = Math.max(...labels.map((l) => l.getBoundingClientRect().width));
    const room = grid.clientWidth ? grid.clientWidth - labelWidth - 20 : 1100;  // 0: not laid out
    const size = Math.max(36, Math.min(110, Math.floor(room / most) - 6));
    grid.innerHTML = "";
    grid.style.gridTemplateColumns = `max-content repeat(${most}, ${size + 2}px)`;
    ENTRIES.forEach((e, li) => {
      grid.appendChild(labels[li]);
      for (let hi = 0; hi < most; hi++) {
        if (hi >= e.heads.length) { grid.appendChild(document.createElement("div")); continue; }
        const c = document.createElement("canvas"), m = mat(li, hi);
        c.className = "mthumb" + (scoreBest(li, hi) ? " best" : "");
        c.dataset.layer = String(li); c.dataset.head = String(hi); c.width = c.height = size;
        c.title = `${e.label}, head ${e.heads[hi].head}` + scoreCaption(li, hi) + ": open in the matrix view";
        c.getContext("2d").putImageData(paint(m, size, size, fullView(m), scaleName()), 0, 0);
        c.addEventListener("click", () => { setLayer(li); setHead(hi); setView("matrix"); });
        grid.appendChild(c);
      }
    });
    $("model-note").textContent = `${ENTRIES.length} layer entr${ENTRIES.length === 1 ? "y" : "ies"} × up to ${most} heads; ` +
      "each thumbnail is its whole matrix (each pixel the max of the cells it covers). A click opens it in the matrix view.";
  }

  // ------------------------------------------------------------------ explain
  const ABOUT = {
    Q: "queries: one row per query token, one column per head dim",
    K: "keys: one row per key token", V: "values: one row per key token",
    scores: "Q·Kᵀ·scale, masked entries −∞, before softmax",
    softmax: "softmax of each row of the scores: the attention weights, each row sums to 1",
    output: "softmax · V: each query's weighted mean of the values",
  };

  function drawExplain() {
    const e = entry(), box = $("view-explain"), hi = shownHead();
    box.innerHTML = "";
    const steps = META.steps.concat(e.steps.filter((s) => s.head === hi));
    if (!steps.length) { box.textContent = "No steps for this layer."; return; }
    if (e.steps.length) {
      const p = document.createElement("p"); p.className = "note";
      p.textContent = `${e.label}, head ${e.heads[hi].head}: the steps of attention, in order.`;
      box.appendChild(p);
    }
    const label = (kind, i) => kind === "q" ? qLabel(e, i) : kind === "k" ? kLabel(e, i) : String(i);
    for (const s of steps) {
      const div = document.createElement("div"); div.className = "step";
      const h = document.createElement("h3");
      h.textContent = `${s.name}  (${s.data.length} × ${s.data[0] ? s.data[0].length : 0})` + (ABOUT[s.name] ? " — " + ABOUT[s.name] : "");
      const scroll = document.createElement("div"); scroll.className = "scroll";
      const t = document.createElement("table"); t.className = "num";
      let big = 0;
      for (const row of s.data) for (const v of row) if (typeof v === "number") big = Math.max(big, Math.abs(v));
      const head = t.insertRow(); head.appendChild(document.createElement("th"));
      (s.data[0] || []).forEach((_, j) => { const th = document.createElement("th"); th.textContent = clip(label(s.cols, j), 12); head.appendChild(th); });
      s.data.forEach((row, i) => {
        const tr = t.insertRow(), th = document.createElement("th");
        th.textContent = clip(label(s.rows, i), 16); tr.appendChild(th);
        for (const v of row) {
          const td = tr.insertCell();
          if (typeof v === "number") {
            td.textContent = fmt(v);
            const a = big > 0 ? Math.abs(v) / big * 0.55 : 0;
            td.style.background = v >= 0 ? `rgba(33,113,181,${a})` : `rgba(214,39,40,${a})`;
          } else td.textContent = v === "-inf" ? "−∞" : v === "inf" ? "∞" : v;
        }
      });
      scroll.appendChild(t); div.appendChild(h); div.appendChild(scroll); box.appendChild(div);
    }
  }

  // ------------------------------------------------------------------ head scores
  const SCORES = META.scores || null;
  let scoreName = SCORES ? SCORES.names[0] : null;

  /** The heads sorted by the chosen score, highest first; heads without it (null) last. */
  function scoreRows() {
    const i = SCORES.names.indexOf(scoreName);
    return SCORES.heads.map((h, n) => [h, n]).sort((a, b) => {
      const x = a[0].values[i], y = b[0].values[i];
      if (x === null || y === null) return (x === null) - (y === null) || a[1] - b[1];
      return y - x || a[1] - b[1];
    }).map((p) => p[0]);
  }

  function bestHeads() { // the three highest-scoring heads: "entry:hi"
    const i = SCORES.names.indexOf(scoreName);
    return new Set(scoreRows().filter((h) => h.values[i] !== null && h.entry !== null).slice(0, 3)
      .map((h) => h.entry + ":" + h.hi));
  }

  function scoreFor(li, hi) { return SCORES ? SCORES.heads.find((h) => h.entry === li && h.hi === hi) : undefined; }
  function scoreCaption(li, hi) {
    const h = scoreFor(li, hi), v = h ? h.values[SCORES.names.indexOf(scoreName)] : null;
    return h ? ` · ${scoreName} ${v === null ? "—" : fmt(v)}` : "";
  }
  function scoreBest(li, hi) { return SCORES ? bestHeads().has(li + ":" + hi) : false; }

  function runsText(runs) {
    const n = runs.reduce((a, r) => a + r[1], 0);
    if (!n) return "none";
    const one = (r) => r[1] === 1 ? String(r[0]) : `${r[0]}..${r[0] + r[1] - 1}`;
    return runs.slice(0, 6).map(one).join(", ") + (runs.length > 6 ? `, … (${runs.length} runs)` : "") +
      ` (${n} row${n === 1 ? "" : "s"})`;
  }

  function drawScores() {
    const t = $("scores-table"), i = SCORES.names.indexOf(scoreName), rows = scoreRows(), best = bestHeads();
    const vals = rows.map((h) => h.values[i]).filter((v) => v !== null);
    const lo = Math.min(...vals), hi = Math.max(...vals);
    t.innerHTML = "";
    const head = t.createTHead().insertRow();
    for (const name of ["layer", "head"].concat(SCORES.names)) {
      const th = document.createElement("th"); th.textContent = name;
      if (name === scoreName) th.className = "chosen";
      head.appendChild(th);
    }
    const body = t.createTBody();
    for (const h of rows) {
      const tr = body.insertRow();
      tr.dataset.layer = String(h.layer); tr.dataset.head = String(h.head);
      if (best.has(h.entry + ":" + h.hi)) tr.className = "best";
      tr.title = h.entry === null ? "this head's weights are not on the page" : "open in the matrix view";
      for (const v of [h.layer, h.head]) tr.insertCell().textContent = String(v);
      h.values.forEach((v, j) => {
        const td = tr.insertCell();
        td.textContent = v === null ? "—" : fmt(v);
        if (j === i && v !== null) td.style.background = `rgba(230,167,0,${hi > lo ? 0.08 + 0.6 * (v - lo) / (hi - lo) : 0.3})`;
      });
      tr.addEventListener("click", () => {
        if (h.entry === null) return;
        setLayer(h.entry); setHead(h.hi); setView("matrix");
      });
    }
    const used = Object.keys(SCORES.used).map((l) => `layer ${l}: ${runsText(SCORES.used[l][scoreName] || [])}`);
    const skipped = Object.keys(SCORES.skipped).map((l) => `layer ${l} not scored: ${SCORES.skipped[l]}`);
    $("scores-rows").textContent = `Rows “${scoreName}” used (mean over these query rows of the kept batch elements): ` +
      used.join("; ") + (skipped.length ? ". " + skipped.join("; ") : "") + ". The three highest are in bold and outlined in the layer overview.";
  }

  function setScore(name) {
    if (!SCORES || !SCORES.names.includes(name)) throw new Error(`setScore: no score ${name}; ` + (SCORES ? SCORES.names.join(", ") : "this page has none"));
    scoreName = name; $("score").value = name; thumbsFor = ""; modelFor = "";
    draw();
  }

  function scoreOrder() { // [layer, head] of the table's rows, top to bottom
    if (!SCORES) return null;
    drawScores();
    return [...$("scores-table").tBodies[0].rows].map((tr) => [+tr.dataset.layer, +tr.dataset.head]);
  }

  // ------------------------------------------------------------------ saliency (rollout, flow)
  const SALIENT = ENTRIES.map((e, i) => i).filter((i) => ENTRIES[i].kind === "rollout" || ENTRIES[i].kind === "flow");
  let sal = SALIENT.length ? { li: SALIENT[0], q: rowsOf(ENTRIES[SALIENT[0]])[ENTRIES[SALIENT[0]].nr - 1], hi: 0 } : null;

  /** Output position q's share from each input token, in the rollout or flow entry li; for a
   *  per-head rollout (several heads), in head chain hi (default 0). */
  function saliency(li, q, hi = 0) {
    const e = ENTRIES[+li];
    if (!e || (e.kind !== "rollout" && e.kind !== "flow") || !(+hi >= 0 && +hi < e.heads.length)) return null;
    const r = posOf(e, +q), m = mat(+li, +hi), out = [];
    if (r < 0) return null;
    for (let c = 0; c < e.S; c++) out.push(m.cell(r, c).v);
    return out;
  }

  function setSaliency(li, q, hi = 0) {
    if (saliency(li, q, hi) === null) throw new Error(`setSaliency: entry ${li} is not a rollout/flow entry with output ${q} and head ${hi}`);
    sal = { li: +li, q: +q, hi: +hi };
    draw();
  }

  function drawSaliency() {
    const of = $("saliency-of"), pos = $("saliency-pos"), hsel = $("saliency-head"), e = ENTRIES[sal.li], rows = rowsOf(e);
    of.innerHTML = "";
    for (const i of SALIENT) { const o = document.createElement("option"); o.value = String(i); o.textContent = ENTRIES[i].label; of.appendChild(o); }
    of.value = String(sal.li);
    pos.innerHTML = "";
    rows.forEach((q, r) => { const o = document.createElement("option"); o.value = String(q); o.textContent = `${q} “${clip(qLabel(e, r), 24)}”`; pos.appendChild(o); });
    pos.value = String(sal.q);
    hsel.innerHTML = "";
    e.heads.forEach((h, i) => { const o = document.createElement("option"); o.value = String(i); o.textContent = `head ${h.head}`; hsel.appendChild(o); });
    hsel.value = String(sal.hi);
    $("saliency-head-label").hidden = e.heads.length < 2;
    const v = saliency(sal.li, sal.q, sal.hi), top = Math.max(...v), box = $("saliency");
    box.innerHTML = "";
    v.forEach((w, c) => {
      const span = document.createElement("span");
      span.className = "tok"; span.dataset.k = String(c);
      span.textContent = kLabel(e, c); span.title = `k=${c} ${fmt(w)}`;
      span.style.background = `rgba(8,81,156,${top > 0 ? 0.85 * w / top : 0})`;
      if (top > 0 && w / top > 0.55) span.style.color = "#fff";
      box.appendChild(span);
    });
    const ranked = v.map((w, c) => [c, w]).sort((a, b) => b[1] - a[1]).slice(0, 10);
    $("saliency-top").textContent = "largest: " + ranked.map(([c, w]) => `k=${c} “${clip(kLabel(e, c), 16)}” ${fmt(w)}`).join(", ");
    const chain = e.heads.length > 1 ? ` through head ${e.heads[sal.hi].head} of every layer` : "";
    $("saliency-note").textContent = `${e.kind === "rollout" ? "rollout: the share of output" : "flow: the max flow into output"} ${sal.q} from each input token${chain} (darker = more; row sums to 1).`;
  }

  // ------------------------------------------------------------------ changes (difference page)
  let changeBy = "mean";

  function drawChanges() {
    const t = $("changes-table"), rows = META.changes.slice().sort( // ties: layer entry, then head (compare().ranked)
      (a, b) => (b[changeBy] - a[changeBy]) || (a.entry - b.entry) || (a.hi - b.hi));
    t.innerHTML = "";
    const head = t.createTHead().insertRow();
    for (const name of ["rank", "layer", "head", "mean |d|", "max |d|"]) { const th = document.createElement("th"); th.textContent = name; head.appendChild(th); }
    const body = t.createTBody();
    rows.forEach((c, n) => {
      const tr = body.insertRow();
      tr.dataset.entry = String(c.entry); tr.dataset.hi = String(c.hi); tr.title = "open in the matrix view";
      for (const v of [n + 1, c.label, c.head, fmt(c.mean), fmt(c.max)]) tr.insertCell().textContent = String(v);
      tr.addEventListener("click", () => { setLayer(c.entry); setHead(c.hi); setView("matrix"); });
    });
  }

  function changeOrder() { // [entry, head position] of the table's rows, most changed first
    if (!META.changes) return null;
    drawChanges();
    return [...$("changes-table").tBodies[0].rows].map((tr) => [+tr.dataset.entry, +tr.dataset.hi]);
  }

  function setChangeBy(name) {
    if (name !== "mean" && name !== "max") throw new Error(`setChangeBy: "mean" or "max", got ${name}`);
    changeBy = name; $("change-by").value = name;
    draw();
  }

  /** [r, g, b] of cell (q, k) of a head on the current colour scale (a difference: diverging). */
  function colourOf(layer, head, q, k) {
    const v = value(layer, head, q, k);
    if (v === null) return null;
    const m = mat(+layer, head === "all" ? 0 : +head);
    if (m.signed) { const i = 3 * shadeSigned(scaleName(), m.vmax)(v); return [DLUT[i], DLUT[i + 1], DLUT[i + 2]]; }
    const i = 3 * shade(scaleName(), m.vmax)(v);
    return [LUT[i], LUT[i + 1], LUT[i + 2]];
  }

  function wireAnalysis() {
    if (SCORES) {
      for (const name of SCORES.names) { const o = document.createElement("option"); o.value = o.textContent = name; $("score").appendChild(o); }
      $("score").addEventListener("change", () => setScore($("score").value));
    }
    if (sal) {
      $("saliency-of").addEventListener("change", () => {
        const li = +$("saliency-of").value, rows = rowsOf(ENTRIES[li]);
        setSaliency(li, rows.includes(sal.q) ? sal.q : rows[rows.length - 1], sal.hi < ENTRIES[li].heads.length ? sal.hi : 0);
      });
      $("saliency-pos").addEventListener("change", () => setSaliency(sal.li, +$("saliency-pos").value, sal.hi));
      $("saliency-head").addEventListener("change", () => setSaliency(sal.li, sal.q, +$("saliency-head").value));
    }
    if (META.changes) $("change-by").addEventListener("change", () => setChangeBy($("change-by").value));
  }

  // ------------------------------------------------------------------ sampling points (deformable)
  // Deformable attention has no weights over keys: each query and head samples each level at
  // P points. One panel per level (the map, a margin around it); each point a dot of its
  // head's colour whose area is proportional to its weight; + marks the reference point.
  const DEFORM = META.deformable || [];
  let dfm = DEFORM.length ? { li: 0, q: rowsOf(DEFORM[0])[0], head: "all" } : null;
  let drawnPoints = []; // the dots of the last drawing (points(), the hover)
  let deformFilled = -1; // the entry whose queries fill #deform-query
  const PANEL = 280, RMAX = 14;
  const MAP_FILL = "#eef1f5", MAP_GRID = "#d9dee6", MAP_EDGE = "#9aa1ad";

  function deformData(li) { // float32: locations (nr, nh, L, P, 2), weights, reference (nr, L, 2)
    const d = DEFORM[li];
    if (!d._data) {
      const buf = blobBytes(d.blob).buffer, n = d.nr * d.heads.length * d.shapes.length * d.P;
      d._data = { loc: new Float32Array(buf, 0, 2 * n), w: new Float32Array(buf, 8 * n, n),
        ref: d.ref ? new Float32Array(buf, 12 * n, 2 * d.nr * d.shapes.length) : null };
    }
    return d._data;
  }

  /** Query q's stored points in entry li, in head, level, point order ({head, hi, level,
   *  point, x, y, w}: x, y in pixels of the level), and its reference point per level. */
  function sampling(li, q) {
    const d = DEFORM[+li];
    if (!d) return null;
    const r = posOf(d, +q);
    if (r < 0) return null;
    const { loc, w, ref } = deformData(+li), nh = d.heads.length, L = d.shapes.length, P = d.P;
    const points = [];
    for (let hi = 0; hi < nh; hi++) for (let l = 0; l < L; l++) for (let p = 0; p < P; p++) {
      const i = ((r * nh + hi) * L + l) * P + p;
      points.push({ head: d.heads[hi], hi, level: l, point: p, x: loc[2 * i], y: loc[2 * i + 1], w: w[i] });
    }
    const refs = ref ? d.shapes.map((_, l) => [ref[2 * (r * L + l)], ref[2 * (r * L + l) + 1]]) : null;
    return { points, ref: refs };
  }

  /** What a level's panel shows, in its pixel coordinates, and the scale: the map, and the
   *  points xy (every head's, so a head's choice keeps the frame) up to a map's size beyond
   *  each side; a margin of 6% for the dots. */
  function panelOf(H, W, xy) {
    let x0 = -0.5, x1 = W - 0.5, y0 = -0.5, y1 = H - 0.5;
    for (const [x, y] of xy) {
      if (x >= -0.5 - W && x <= 2 * W - 0.5) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); }
      if (y >= -0.5 - H && y <= 2 * H - 0.5) { y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
    }
    const m = 0.06 * Math.max(x1 - x0, y1 - y0);
    x0 -= m; x1 += m; y0 -= m; y1 += m;
    const s = PANEL / Math.max(x1 - x0, y1 - y0);
    return { x0, y0, s, cw: Math.round((x1 - x0) * s), ch: Math.round((y1 - y0) * s) };
  }

  function fillDeformSelects() {
    const d = DEFORM[dfm.li], of = $("deform-of"), qs = $("deform-query"), hs = $("deform-head");
    if (of.options.length !== DEFORM.length) {
      DEFORM.forEach((e, i) => { const o = document.createElement("option"); o.value = String(i); o.textContent = e.label; of.appendChild(o); });
    }
    of.value = String(dfm.li);
    if (deformFilled !== dfm.li) {
      qs.innerHTML = ""; hs.innerHTML = "";
      for (const q of rowsOf(d)) { const o = document.createElement("option"); o.value = o.textContent = String(q); qs.appendChild(o); }
      const add = (v, t) => { const o = document.createElement("option"); o.value = v; o.textContent = t; hs.appendChild(o); };
      add("all", `all (${d.heads.length})`);
      d.heads.forEach((h, i) => add(String(i), "head " + h));
      deformFilled = dfm.li;
    }
    qs.value = String(dfm.q); hs.value = String(dfm.head);
  }

  function drawDeformable() {
    fillDeformSelects();
    const d = DEFORM[dfm.li], L = d.shapes.length, data = sampling(dfm.li, dfm.q);
    const shown = data.points.filter((p) => dfm.head === "all" || p.hi === dfm.head);
    const wmax = shown.reduce((a, p) => Math.max(a, p.w), 0);
    $("summary").textContent = `${d.label}: ${d.nr} of ${d.Lq} queries kept, ${d.heads.length} head` +
      `${d.heads.length === 1 ? "" : "s"}, ${L} level${L === 1 ? "" : "s"} × ${d.P} point${d.P === 1 ? "" : "s"}` +
      ` · ${DEFORM.length} deformable call${DEFORM.length === 1 ? "" : "s"}`;
    $("precision").textContent = "Sampling points and weights stored as float32: the numbers shown are the trace's, to toPrecision(4).";
    const box = $("levels");
    box.innerHTML = "";
    drawnPoints = [];
    d.shapes.forEach(([H, W], l) => {
      const xy = data.points.filter((p) => p.level === l).map((p) => [p.x, p.y]).concat(data.ref ? [data.ref[l]] : []);
      const g = panelOf(H, W, xy), fig = document.createElement("figure"), c = document.createElement("canvas");
      fig.style.width = (g.cw + 2) + "px";
      c.className = "level"; c.dataset.level = String(l); c.width = g.cw; c.height = g.ch;
      const ctx = c.getContext("2d"), X = (x) => (x - g.x0) * g.s, Y = (y) => (y - g.y0) * g.s;
      ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, g.cw, g.ch);
      ctx.fillStyle = MAP_FILL; ctx.fillRect(X(-0.5), Y(-0.5), W * g.s, H * g.s);
      if (g.s >= 8) { // pixel boundaries, once pixels are large enough to tell apart
        ctx.strokeStyle = MAP_GRID; ctx.lineWidth = 1; ctx.beginPath();
        for (let i = 1; i < W; i++) { ctx.moveTo(Math.round(X(i - 0.5)) + 0.5, Y(-0.5)); ctx.lineTo(Math.round(X(i - 0.5)) + 0.5, Y(H - 0.5)); }
        for (let j = 1; j < H; j++) { ctx.moveTo(X(-0.5), Math.round(Y(j - 0.5)) + 0.5); ctx.lineTo(X(W - 0.5), Math.round(Y(j - 0.5)) + 0.5); }
        ctx.stroke();
      }
      ctx.strokeStyle = MAP_EDGE; ctx.strokeRect(X(-0.5), Y(-0.5), W * g.s, H * g.s);
      // Larger dots first, so a small one on top of a large one stays visible.
      const mine = shown.filter((p) => p.level === l).sort((a, b) => b.w - a.w);
      let outside = 0;
      for (const p of mine) {
        const cx = X(p.x), cy = Y(p.y), r = wmax > 0 ? RMAX * Math.sqrt(p.w / wmax) : 0;
        const drawn = cx >= 0 && cy >= 0 && cx <= g.cw && cy <= g.ch;
        if (!drawn) outside++;
        else if (r > 0) {
          ctx.globalAlpha = 0.75; ctx.fillStyle = headColour(p.hi);
          ctx.beginPath(); ctx.arc(cx, cy, r, 0, 2 * Math.PI); ctx.fill(); ctx.globalAlpha = 1;
        }
        drawnPoints.push(Object.assign({ canvas: c, cx, cy, r, drawn }, p));
      }
      let caption = `level ${l} · ${H}×${W}`;
      if (data.ref) {
        const [rx, ry] = data.ref[l], cx = X(rx), cy = Y(ry);
        ctx.lineWidth = 4; ctx.strokeStyle = "#fff"; cross(ctx, cx, cy);
        ctx.lineWidth = 2; ctx.strokeStyle = "#1d2433"; cross(ctx, cx, cy);
        caption += ` · reference (${fmt(rx)}, ${fmt(ry)})`;
      }
      if (outside) caption += ` · ${outside} point${outside === 1 ? "" : "s"} outside the panel`;
      const cap = document.createElement("figcaption"); cap.textContent = caption;
      fig.appendChild(c); fig.appendChild(cap); box.appendChild(fig);
    });
    const heads = dfm.head === "all" ? d.heads.map((_, i) => i) : [dfm.head];
    $("deform-legend").innerHTML = "";
    for (const hi of heads) {
      const s = document.createElement("span"), i = document.createElement("i");
      i.style.background = headColour(hi); s.appendChild(i);
      s.appendChild(document.createTextNode("head " + d.heads[hi])); $("deform-legend").appendChild(s);
    }
    $("deform-note").textContent = `Query ${dfm.q}: each dot is a sampling point, coloured by head; its area is proportional ` +
      `to its weight (the largest shown, w = ${fmt(wmax)}, has radius ${RMAX} px)` + (data.ref ? "; + marks the query's reference point" : "") +
      ". Pixel coordinates as grid_sample's align_corners=False: x·W − 0.5, y·H − 0.5 (pixel centres at integers; a map spans −0.5 .. W − 0.5). Hover a dot for its numbers.";
    const t = $("deform-table");
    t.innerHTML = "";
    const head = t.createTHead().insertRow();
    for (const name of ["head", "level", "point", "x (px)", "y (px)", "weight"]) { const th = document.createElement("th"); th.textContent = name; head.appendChild(th); }
    const body = t.createTBody();
    for (const p of shown) {
      const tr = body.insertRow();
      for (const v of [p.head, p.level, p.point, fmt(p.x), fmt(p.y), fmt(p.w)]) tr.insertCell().textContent = String(v);
    }
  }

  function cross(ctx, x, y) {
    ctx.beginPath(); ctx.moveTo(x - 7, y); ctx.lineTo(x + 7, y); ctx.moveTo(x, y - 7); ctx.lineTo(x, y + 7); ctx.stroke();
  }

  /** The dots drawn now: each stored point ({head, hi, level, point, x, y, w}) with where it
   *  is drawn (cx, cy: client coordinates of its centre; canvasX, canvasY in its level's
   *  canvas; r: radius in canvas pixels) and whether it is inside its panel (drawn). */
  function points() {
    return drawnPoints.map((p) => {
      const rect = p.canvas.getBoundingClientRect(), kx = rect.width / p.canvas.width, ky = rect.height / p.canvas.height;
      return { head: p.head, hi: p.hi, level: p.level, point: p.point, x: p.x, y: p.y, w: p.w, drawn: p.drawn,
        r: p.r, canvasX: p.cx, canvasY: p.cy, cx: rect.left + p.cx * kx, cy: rect.top + p.cy * ky };
    });
  }

  function setDeformable(li, q, head = "all") {
    const d = DEFORM[+li];
    if (!d) throw new Error(`setDeformable: no deformable entry ${li}; ${DEFORM.length ? "0.." + (DEFORM.length - 1) : "this page has none"}`);
    if (posOf(d, +q) < 0) throw new Error(`setDeformable: query ${q} was not kept in ${d.label}; kept: ${runsText(d.rows)}`);
    if (head !== "all" && !(Number.isInteger(+head) && +head >= 0 && +head < d.heads.length)) {
      throw new Error(`setDeformable: no head position ${head}; "all" or 0..${d.heads.length - 1}`);
    }
    dfm = { li: +li, q: +q, head: head === "all" ? "all" : +head };
    if (state.view !== "deformable") setView("deformable"); else draw();
  }

  function hoverPoint(ev) {
    const tip = $("tooltip"), c = ev.target;
    let best = null, bestD = Infinity;
    if (c.tagName === "CANVAS") {
      const rect = c.getBoundingClientRect(), x = (ev.clientX - rect.left) * c.width / rect.width, y = (ev.clientY - rect.top) * c.height / rect.height;
      for (const p of drawnPoints) {
        if (p.canvas !== c || !p.drawn) continue;
        const dist = Math.hypot(p.cx - x, p.cy - y);
        if (dist <= p.r + 3 && dist < bestD) { best = p; bestD = dist; }
      }
    }
    if (!best) { tip.style.display = "none"; return; }
    tip.textContent = `head ${best.head} level ${best.level} point ${best.point}: x=${fmt(best.x)} y=${fmt(best.y)} w=${fmt(best.w)}`;
    tip.style.display = "block";
    tip.style.left = (ev.clientX + 14) + "px"; tip.style.top = (ev.clientY + 14) + "px";
  }

  function wireDeformable() {
    if (!dfm) return;
    $("deform-of").addEventListener("change", () => {
      const li = +$("deform-of").value, rows = rowsOf(DEFORM[li]);
      setDeformable(li, rows.includes(dfm.q) ? dfm.q : rows[0], "all");
    });
    $("deform-query").addEventListener("change", () => setDeformable(dfm.li, +$("deform-query").value, dfm.head));
    $("deform-head").addEventListener("change", () => setDeformable(dfm.li, dfm.q, $("deform-head").value));
    $("levels").addEventListener("mousemove", hoverPoint);
    $("levels").addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });
  }

  // ------------------------------------------------------------------ views and selectors
  const PRECISION = {
    f4: "stored as float32: exact to the digits shown",
    f2: "stored as float16: |error| ≤ max(w·2⁻¹¹, 2⁻²⁵)",
    top: "stored: block maxima and each row's top-k weights as float16, |error| ≤ max(w·2⁻¹¹, 2⁻²⁵)",
    s4: "a difference, stored as float32: exact to the digits shown",
    s2: "a difference, stored as float16: |error| ≤ max(|d|·2⁻¹¹, 2⁻²⁵)",
    sb: "a difference, too large to keep whole: each block's value of largest |d| (float16)",
  };

  function draw() {
    if (state.view === "deformable") { drawDeformable(); return; }
    const e = entry(), hi = shownHead(), h = e.heads[hi];
    $("summary").textContent = `${e.label}: ${e.nr} of ${e.T} query rows, ${e.S} keys, ${e.heads.length} head` +
      (e.heads.length === 1 ? "" : "s") + ` · ${META.entries.length} layer entr${META.entries.length === 1 ? "y" : "ies"}`;
    $("precision").textContent = `Head ${h.head}: ${PRECISION[h.mode]}` +
      (h.mode === "top" ? ` (blocks of ${h.block}×${h.block} cells, top ${h.k} per row; other cells not stored).`
        : h.mode === "sb" ? ` (blocks of ${h.block}×${h.block} cells).` : ".") +
      " Hover shows toPrecision(4) of the stored value.";
    if (state.view === "head") drawHead();
    else if (state.view === "matrix") drawMatrix();
    else if (state.view === "overview") drawOverview();
    else if (state.view === "model") drawModel();
    else if (state.view === "scores") drawScores();
    else if (state.view === "saliency") drawSaliency();
    else if (state.view === "changes") drawChanges();
    else drawExplain();
  }

  function setView(name) {
    if (!VIEWS.includes(name)) throw new Error(`setView: no view ${name}; views: ${VIEWS.join(", ")}`);
    state.view = name;
    for (const v of VIEWS) {
      $("view-" + v).classList.toggle("active", v === name);
      $("tab-" + v).classList.toggle("active", v === name);
    }
    $("tooltip").style.display = "none";
    draw();
  }

  function fillHeads() {
    const e = entry(), sel = $("head");
    sel.innerHTML = "";
    const add = (value, text) => { const o = document.createElement("option"); o.value = value; o.textContent = text; sel.appendChild(o); };
    add("all", `all (${e.heads.length})`);
    e.heads.forEach((h, i) => add(String(i), "head " + h.head));
    sel.value = String(state.head);
  }

  function setLayer(i) {
    i = +i;
    if (!(Number.isInteger(i) && i >= 0 && i < ENTRIES.length)) throw new Error(`setLayer: no layer ${i}; 0..${ENTRIES.length - 1}`);
    state.layer = i;
    if (state.head !== "all" && state.head >= entry().heads.length) state.head = "all";
    $("layer").value = String(i);
    fillHeads(); resetHeadWindows();
    draw();
  }

  function setHead(h) {
    const n = entry().heads.length;
    if (h !== "all") {
      h = +h;
      if (!(Number.isInteger(h) && h >= 0 && h < n)) throw new Error(`setHead: no head ${h}; "all" or 0..${n - 1}`);
    }
    state.head = h;
    $("head").value = String(h);
    focus = null;
    draw();
  }

  function digest(id) {
    // Read a copy: repeated getImageData on the view's own context makes Chromium warn.
    const c = $(id), copy = document.createElement("canvas");
    copy.width = c.width; copy.height = c.height;
    const cx = copy.getContext("2d", { willReadFrequently: true });
    cx.drawImage(c, 0, 0);
    const d = cx.getImageData(0, 0, c.width, c.height).data;
    let h = 0x811c9dc5;
    for (let i = 0; i < d.length; i++) { h ^= d[i]; h = Math.imul(h, 0x01000193); }
    return (h >>> 0).toString(16).padStart(8, "0");
  }

  function init() {
    const sel = $("layer");
    ENTRIES.forEach((e, i) => { const o = document.createElement("option"); o.value = String(i); o.textContent = e.label; sel.appendChild(o); });
    sel.addEventListener("change", () => setLayer(sel.value));
    $("head").addEventListener("change", () => setHead($("head").value));
    for (const v of VIEWS) $("tab-" + v).addEventListener("click", () => setView(v));
    wireMatrix(); wireHead(); wireAnalysis(); wireDeformable();
    state.head = "all";
    if (ENTRIES.length) { state.layer = 0; $("layer").value = "0"; fillHeads(); resetHeadWindows(); }
    else { // deformable attention alone: no weights over keys, so none of their views
      for (const id of ["tab-head", "tab-matrix", "tab-overview", "tab-model"]) $(id).hidden = true;
      $("layer").parentElement.hidden = true; $("head").parentElement.hidden = true;
    }
    window.qkvViewer = { state, value, exact, cellAt, cellCenter, digest, setView, setLayer, setHead,
      setScore, scoreOrder, saliency, setSaliency, changeOrder, setChangeBy, colourOf,
      sampling, points, setDeformable };
    setView(!ENTRIES.length ? "deformable" : ENTRIES[0].kind === "diff" ? "matrix" : "head");
    document.body.dataset.ready = "1";
  }

  init();
})();
