"""JavaScript and CSS of the schedule page (``fedagg viz schedule``), as Python strings."""

from __future__ import annotations

__all__ = ["SCHEDULE_CSS", "SCHEDULE_JS"]

SCHEDULE_CSS = """
.panels { display: flex; flex-wrap: wrap; gap: 12px; }
.panel.sched { width: 440px; }
.panels.three .panel.sched { width: 410px; }
.controls[hidden] { display: none; }
.controls { display: flex; gap: 6px; align-items: center; margin: 6px 0; flex-wrap: wrap; }
.stepinfo { font-size: 12px; min-height: 36px; }
.timeline { display: flex; align-items: flex-end; gap: 2px; height: 34px; margin-top: 4px; }
.timeline div { flex: 1; background: #c5ccd8; min-height: 2px; border-radius: 1px; cursor: pointer; }
.timeline div.reduce { background: #f3b38a; } .timeline div.copy { background: #9cc3ee; }
.timeline div.now { outline: 2px solid var(--fg); }
.legend span { display: inline-block; margin-right: 12px; }
.sw { display: inline-block; width: 18px; height: 4px; vertical-align: middle; margin-right: 4px; }
.bar { height: 12px; background: var(--copy); display: inline-block; vertical-align: middle; }
.bar.ps { background: var(--reduce); }
td.num { font-variant-numeric: tabular-nums; }
"""

SCHEDULE_JS = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("fedagg-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(tag, attrs, text, parent) {
    const e = document.createElement(tag);
    for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmtBytes(b) {
    if (b >= 1 << 30) return (b / (1 << 30)).toFixed(2) + " GiB";
    if (b >= 1 << 20) return (b / (1 << 20)).toFixed(2) + " MiB";
    if (b >= 1 << 10) return (b / (1 << 10)).toFixed(1) + " KiB";
    return b + " B";
  }
  function fmtMs(s) { return (s * 1e3).toPrecision(3) + " ms"; }
  const GROUP_COLOURS = ["#5f3dc4", "#087f5b", "#c2255c", "#1864ab", "#e67700", "#495057"];

  function Panel(p, host) {
    const self = this;
    const nNodes = p.nodes.length, nChunks = p.chunks.length, K = p.steps.length;
    const W = 400, H = 380, cx = W / 2, cy = H / 2 + 6;
    const isPs = p.algorithm === "ps";
    const root = h("div", {"class": "panel sched", "data-algorithm": p.algorithm}, null, host);
    root.dataset.steps = String(K);
    root.dataset.current = "0";
    root.dataset.done = K === 0 ? "1" : "0";
    const title = p.algorithm === "ps" ? "parameter server" : p.algorithm + " all-reduce";
    h("h3", null, title + " \u00b7 N = " + p.workers + " \u00b7 " + K + " steps", root);
    h("div", {"class": "muted small"}, p.source, root);
    if (p.groups) {
      h("div", {"class": "muted small"}, "groups (border colour): " + p.groups.map(function (g) {
        return "{" + g.map(function (r) { return "r" + r; }).join(",") + "}"; }).join(" ") +
        "; leader = first rank of each group", root);
    }
    const controls = h("div", {"class": "controls"}, null, root);
    const bReset = h("button", {"data-action": "reset", "title": "back to the start"}, "reset", controls);
    const bBack = h("button", {"data-action": "back", "title": "one step back"}, "\u25c0 back", controls);
    const bPlay = h("button", {"data-action": "play"}, "\u25b6 play", controls);
    const bStep = h("button", {"data-action": "step", "title": "one step"}, "step \u25b6", controls);
    const svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img"}, root);
    const defs = el("defs", {}, svg);
    for (const op of ["reduce", "copy"]) {
      const m = el("marker", {id: "arr-" + p.algorithm + "-" + op, viewBox: "0 0 10 10", refX: 9, refY: 5,
                              markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse"}, defs);
      el("path", {d: "M 0 0 L 10 5 L 0 10 z", fill: op === "reduce" ? "#e8590c" : "#1c7ed6"}, m);
    }
    const pos = [];
    const ringR = Math.min(W, H) / 2 - 46;
    for (let i = 0; i < nNodes; i++) {
      if (isPs && i === nNodes - 1) { pos.push([cx, cy]); continue; }
      const n = isPs ? nNodes - 1 : nNodes;
      const a = -Math.PI / 2 + 2 * Math.PI * i / n;
      pos.push([cx + ringR * Math.cos(a), cy + ringR * Math.sin(a)]);
    }
    const groupOf = {};
    (p.groups || []).forEach(function (g, gi) { g.forEach(function (r) { groupOf[r] = gi; }); });
    const arrows = el("g", {}, svg), nodesG = el("g", {}, svg), dots = el("g", {}, svg);
    const boxW = Math.max(44, Math.min(72, 8 * nChunks + 8)), boxH = 30;
    const cells = [];
    for (let i = 0; i < nNodes; i++) {
      const [x, y] = pos[i];
      const g = el("g", {transform: "translate(" + (x - boxW / 2) + "," + (y - boxH / 2) + ")"}, nodesG);
      const stroke = (i in groupOf) ? GROUP_COLOURS[groupOf[i] % GROUP_COLOURS.length] : "#5b6475";
      el("rect", {width: boxW, height: boxH, rx: 4, fill: "#fff", stroke: stroke,
                  "stroke-width": (i in groupOf) ? 2 : 1}, g);
      const t = el("text", {x: boxW / 2, y: -4, "text-anchor": "middle", "font-size": 11, fill: "#1d2330"}, g);
      t.textContent = p.nodes[i];
      const cw = (boxW - 6) / nChunks, row = [];
      for (let c = 0; c < nChunks; c++) {
        el("rect", {x: 3 + c * cw, y: 3, width: Math.max(cw - 1, 1), height: boxH - 6, fill: "#eef1f5"}, g);
        const r = el("rect", {x: 3 + c * cw, y: 3, width: Math.max(cw - 1, 1), height: 0, fill: "#f59f00"}, g);
        row.push(r);
      }
      cells.push(row);
    }
    const info = h("div", {"class": "stepinfo"}, "", root);
    const tl = h("div", {"class": "timeline", "title": "bytes per step"}, null, root);
    const maxB = Math.max(1, ...p.steps.map(function (s) { return s.bytes; }));
    const tlBars = p.steps.map(function (s, i) {
      const ops = new Set(s.transfers.map(function (t) { return t[3]; }));
      const b = h("div", {"class": ops.size === 1 ? [...ops][0] : "", "title":
        "step " + (i + 1) + ": " + fmtBytes(s.bytes)}, null, tl);
      b.style.height = Math.max(2, 34 * s.bytes / maxB) + "px";
      b.addEventListener("click", function () { self.jump(i + 1); });
      return b;
    });

    let k = 0, timer = null, anim = null;
    function paintCounts(state) {
      const counts = p.counts[state];
      for (let i = 0; i < nNodes; i++) for (let c = 0; c < nChunks; c++) {
        const v = counts[i][c], r = cells[i][c], full = boxH - 6;
        const hgt = full * v / p.workers;
        r.setAttribute("height", hgt);
        r.setAttribute("y", 3 + full - hgt);
        r.setAttribute("fill", v >= p.workers ? "#2b8a3e" : "#f59f00");
      }
    }
    function drawArrows(stepIndex) {
      while (arrows.firstChild) arrows.removeChild(arrows.firstChild);
      while (dots.firstChild) dots.removeChild(dots.firstChild);
      if (stepIndex < 0) return [];
      const pairs = {};
      for (const t of p.steps[stepIndex].transfers) {
        const key = t[0] + ">" + t[1];
        (pairs[key] = pairs[key] || {src: t[0], dst: t[1], op: t[3], chunks: []}).chunks.push(t[2]);
      }
      const moving = [];
      for (const key in pairs) {
        const q = pairs[key];
        const [x1, y1] = pos[q.src], [x2, y2] = pos[q.dst];
        const dx = x2 - x1, dy = y2 - y1, len = Math.hypot(dx, dy) || 1;
        const ox = -dy / len * 6, oy = dx / len * 6, sh = (boxH / 2 + 4) / len;
        const a = [x1 + dx * sh + ox, y1 + dy * sh + oy], b = [x2 - dx * sh + ox, y2 - dy * sh + oy];
        const colour = q.op === "reduce" ? "#e8590c" : "#1c7ed6";
        el("line", {x1: a[0], y1: a[1], x2: b[0], y2: b[1], stroke: colour, "stroke-width": 2,
                    "stroke-dasharray": q.op === "copy" ? "6 3" : "none",
                    "marker-end": "url(#arr-" + p.algorithm + "-" + q.op + ")",
                    "data-op": q.op}, arrows);
        const lt = el("text", {x: (a[0] + b[0]) / 2 + ox, y: (a[1] + b[1]) / 2 + oy, "font-size": 10,
                               fill: colour, "text-anchor": "middle"}, arrows);
        lt.textContent = "c" + q.chunks.join(",c");
        moving.push({a: a, b: b, dot: el("circle", {r: 4, fill: colour, cx: a[0], cy: a[1]}, dots)});
      }
      return moving;
    }
    function describe() {
      if (k === 0) { info.textContent = "start: every rank holds only its own input (bar height = inputs summed into that chunk)"; return; }
      const s = p.steps[k - 1];
      const ops = {};
      for (const t of s.transfers) ops[t[3]] = (ops[t[3]] || 0) + 1;
      const opText = Object.keys(ops).map(function (o) { return ops[o] + " " + o; }).join(", ");
      info.textContent = "step " + k + "/" + K + ": " + s.transfers.length + " transfers (" + opText +
        "), " + fmtBytes(s.bytes) + " on the wire, at most " + fmtBytes(s.max_node_bytes) + " sent by one node" +
        (k === K ? " \u2014 done: every copy holds all " + p.workers + " inputs" : "");
    }
    function finishAnim() {
      if (anim) { cancelAnimationFrame(anim.id); anim = null; }
    }
    function show(animate) {
      finishAnim();
      root.dataset.current = String(k);
      root.dataset.done = k >= K ? "1" : "0";
      tlBars.forEach(function (b, i) { b.classList.toggle("now", i === k - 1); });
      describe();
      const moving = drawArrows(k - 1);
      if (!animate || moving.length === 0) { paintCounts(k); moving.forEach(function (m) { m.dot.remove(); }); return; }
      paintCounts(k - 1);
      const t0 = performance.now(), dur = 450, target = k;
      const tick = function (now) {
        const f = Math.min(1, (now - t0) / dur);
        for (const m of moving) {
          m.dot.setAttribute("cx", m.a[0] + (m.b[0] - m.a[0]) * f);
          m.dot.setAttribute("cy", m.a[1] + (m.b[1] - m.a[1]) * f);
        }
        if (f < 1) { anim.id = requestAnimationFrame(tick); }
        else { anim = null; moving.forEach(function (m) { m.dot.remove(); }); paintCounts(target); }
      };
      anim = {id: requestAnimationFrame(tick)};
    }
    this.step = function () { if (k < K) { k += 1; show(true); } return k < K; };
    this.back = function () { if (k > 0) { k -= 1; show(false); } };
    this.jump = function (to) { k = Math.max(0, Math.min(K, to)); show(false); };
    this.reset = function () { self.pause(); k = 0; show(false); };
    this.pause = function () { if (timer) { clearInterval(timer); timer = null; } bPlay.textContent = "\u25b6 play"; };
    this.play = function () {
      if (timer) return;
      if (k >= K) { k = 0; show(false); }
      bPlay.textContent = "\u2016 pause";
      timer = setInterval(function () { if (!self.step()) self.pause(); }, 700);
    };
    this.toggle = function () { if (timer) self.pause(); else self.play(); };
    this.numSteps = K;
    this.current = function () { return k; };
    bReset.addEventListener("click", this.reset);
    bBack.addEventListener("click", function () { self.pause(); self.back(); });
    bStep.addEventListener("click", function () { self.pause(); self.step(); });
    bPlay.addEventListener("click", this.toggle);
    show(false);
  }

  const host = document.getElementById("panels");
  if (D.panels.length > 1) host.classList.add("three");
  const panels = D.panels.map(function (p) { return new Panel(p, host); });
  const all = document.getElementById("all-controls");
  if (panels.length > 1) {
    all.hidden = false;
    const acts = {"play-all": function (q) { q.play(); }, "pause-all": function (q) { q.pause(); },
                  "step-all": function (q) { q.pause(); q.step(); }, "reset-all": function (q) { q.reset(); }};
    for (const a in acts) {
      all.querySelector('[data-action="' + a + '"]').addEventListener("click", function () { panels.forEach(acts[a]); });
    }
  }

  // cost table: predicted (alpha-beta-gamma model) and measured (docs/benchmarks.md)
  const tbody = document.querySelector("#cost tbody");
  const measured = {};
  for (const r of D.measured.rows) measured[r.algorithm] = r.median_ms;
  const maxT = Math.max(...D.cost.map(function (r) { return r.predicted_s; }), 1e-12);
  for (const r of D.cost) {
    const tr = h("tr", {"data-algorithm": r.algorithm}, null, tbody);
    h("td", null, r.algorithm === "ps" ? "parameter server" : r.algorithm, tr);
    h("td", {"class": "num"}, String(r.steps), tr);
    h("td", {"class": "num"}, fmtBytes(r.max_bytes_sent_per_rank) +
      (r.server_link_bytes ? " (server link " + fmtBytes(r.server_link_bytes) + ")" : ""), tr);
    const td = h("td", {"class": "num", "data-predicted-s": String(r.predicted_s)}, null, tr);
    const bar = h("span", {"class": r.algorithm === "ps" ? "bar ps" : "bar"}, null, td);
    bar.style.width = Math.max(1, 120 * r.predicted_s / maxT) + "px";
    td.appendChild(document.createTextNode(" " + fmtMs(r.predicted_s)));
    h("td", {"class": "num"}, r.algorithm in measured ? measured[r.algorithm].toFixed(2) + " ms" : "\u2013", tr);
    h("td", {"class": "small muted"}, r.formula, tr);
  }
  const mnote = document.getElementById("measured-note");
  if (D.measured.rows.length) {
    mnote.textContent = "Measured: median of one all-reduce at N = " + D.workers + ", " +
      fmtBytes(D.measured.bytes) + " (nearest measured size), from docs/benchmarks.md" +
      (D.measured.section ? ", section \u201c" + D.measured.section + "\u201d" : "") + ("native" in measured ? "; native gloo: " + measured.native.toFixed(2) + " ms." : ".");
  } else {
    mnote.textContent = "No measured figure at N = " + D.workers + " in docs/benchmarks.md (predictions only).";
  }
  window.fedaggViz = {panels: panels, data: D};
  document.body.dataset.ready = "1";
})();
"""
