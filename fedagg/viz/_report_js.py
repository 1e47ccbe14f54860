"""HTML body, CSS and JavaScript of the run report (``fedagg report``), as Python strings."""

from __future__ import annotations

__all__ = ["REPORT_BODY", "REPORT_CSS", "REPORT_JS"]

REPORT_CSS = """
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 6px 8px; }
.chart h3 { margin: 2px 0 2px; }
.kv { display: flex; flex-wrap: wrap; gap: 18px; margin: 6px 0; }
.kv div b { display: block; font-size: 18px; }
#tip { position: fixed; pointer-events: none; background: #1d2330; color: #fff; font-size: 12px;
       padding: 4px 7px; border-radius: 4px; max-width: 420px; display: none; z-index: 9; }
.swatch { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; vertical-align: middle; }
"""

REPORT_BODY = """
<h1 id="title">fedagg run report</h1>
<div class="muted small" id="subtitle"></div>
<div class="muted small" id="provenance"></div>
<div class="kv" id="summary"></div>
<h2>Model quality</h2><div class="muted small" id="quality-note"></div><div class="charts" id="quality"></div>
<div id="federated-box"><h2>Federated evaluation</h2><div class="muted small" id="federated-note"></div>
<div class="charts" id="federated"></div></div>
<div id="async-box"><h2>Versions and staleness</h2><div class="muted small" id="async-note"></div>
<div class="charts" id="async"></div></div>
<h2>Traffic</h2><div class="muted small" id="traffic-note"></div><div class="charts" id="traffic"></div>
<h2>Time per round</h2><div class="muted small" id="time-note"></div><div class="charts" id="time"></div>
<h2>Sites &times; rounds</h2>
<div class="muted small">Hover a cell for the reason. Rows <i>site p</i> are partition ids
(accepted = its update went into the aggregate); rows <i>node n</i> are Flower node ids whose
update the server rejected.</div>
<div class="charts" id="sites-map"></div>
<h2>Intra-site training</h2><div class="muted small" id="site-note"></div>
<div class="charts" id="site-charts"></div><table id="site-table"></table>
<h2>Secure aggregation</h2><div id="secagg"></div>
<h2>Differential privacy</h2><div id="privacy"></div>
<h2>Configuration</h2><pre id="config"></pre>
<div id="tip"></div>
"""

REPORT_JS = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("fedagg-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const COLOURS = ["#1c7ed6", "#e8590c", "#2b8a3e", "#ae3ec9", "#f59f00", "#0c8599", "#c92a2a", "#5c940d"];
  const tip = document.getElementById("tip");
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
  function hover(node, text) {
    el("title", {}, node).textContent = text;
    node.addEventListener("mousemove", function (ev) {
      tip.textContent = text; tip.style.display = "block";
      tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
    });
    node.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  }
  function fmtBytes(b) {
    if (b === null || b === undefined) return "\u2013";
    const a = Math.abs(b);
    if (a >= 1e9) return (b / 1e9).toFixed(2) + " GB";
    if (a >= 1e6) return (b / 1e6).toFixed(2) + " MB";
    if (a >= 1e3) return (b / 1e3).toFixed(1) + " kB";
    return b.toFixed(0) + " B";
  }
  function fmtNum(v, d) { return v === null || v === undefined ? "\u2013" : Number(v).toFixed(d === undefined ? 3 : d); }
  function nice(max) {
    if (!(max > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(max))), f = max / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }

  // A chart over rounds. series: [{name, values, kind: "line"|"bar"}]; values aligned with xs.
  function chart(host, id, title, xs, series, opts) {
    opts = opts || {};
    const W = opts.width || 440, H = opts.height || 220, L = 56, R = 12, T = 10, B = 34;
    const box = h("div", {"class": "chart"}, null, host);
    h("h3", null, title, box);
    const legend = h("div", {"class": "small"}, null, box);
    series.forEach(function (s, i) {
      const sw = h("span", {"class": "swatch"}, null, legend);
      sw.style.background = s.colour || COLOURS[i % COLOURS.length];
      legend.appendChild(document.createTextNode(s.name));
    });
    const svg = el("svg", {width: W, height: H, "data-chart": id}, box);
    let vmax = 0, vmin = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v !== undefined) {
      vmax = Math.max(vmax, v); vmin = Math.min(vmin, v);
    }
    if (opts.ymax !== undefined) vmax = Math.max(vmax, opts.ymax);
    const top = nice(vmax), n = xs.length;
    const xAt = function (i) { return L + (n <= 1 ? (W - L - R) / 2 : (W - L - R) * (i + 0.5) / n); };
    const yAt = function (v) { return T + (H - T - B) * (1 - (v - vmin) / ((top - vmin) || 1)); };
    for (let g = 0; g <= 4; g++) {
      const v = vmin + (top - vmin) * g / 4, y = yAt(v);
      el("line", {x1: L, x2: W - R, y1: y, y2: y, stroke: "#d7dce4"}, svg);
      el("text", {x: L - 4, y: y + 4, "text-anchor": "end", "font-size": 10, fill: "#5b6475"}, svg)
        .textContent = opts.fmt ? opts.fmt(v) : fmtNum(v, 2);
    }
    const every = Math.max(1, Math.ceil(n / 12));
    xs.forEach(function (x, i) {
      if (i % every === 0) el("text", {x: xAt(i), y: H - B + 14, "text-anchor": "middle", "font-size": 10,
                                       fill: "#5b6475"}, svg).textContent = String(x);
    });
    el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", "font-size": 11, fill: "#5b6475"}, svg)
      .textContent = opts.xlabel || XLABEL;
    const bars = series.filter(function (s) { return s.kind === "bar"; });
    const slot = (W - L - R) / Math.max(n, 1), bw = Math.max(1, slot * 0.8 / Math.max(bars.length, 1));
    series.forEach(function (s, si) {
      const colour = s.colour || COLOURS[si % COLOURS.length];
      const g = el("g", {"data-series": s.key || s.name}, svg);
      if (s.kind === "bar") {
        const bi = bars.indexOf(s);
        s.values.forEach(function (v, i) {
          if (v === null || v === undefined) return;
          const x = xAt(i) - slot * 0.4 + bi * bw, y = yAt(Math.max(v, 0)), y0 = yAt(0);
          const r = el("rect", {x: x, y: Math.min(y, y0), width: bw, height: Math.abs(y0 - y), fill: colour,
                                "data-round": String(xs[i]), "data-value": String(v), "class": "pt"}, g);
          hover(r, s.name + ", round " + xs[i] + ": " + (opts.fmt ? opts.fmt(v) : fmtNum(v, 4)));
        });
        return;
      }
      const d = [];
      let down = false;
      s.values.forEach(function (v, i) {
        if (v === null || v === undefined) { down = false; return; }
        d.push((down ? "L" : "M") + xAt(i).toFixed(1) + "," + yAt(v).toFixed(1));
        down = true;
      });
      if (d.length) el("path", {d: d.join(" "), fill: "none", stroke: colour, "stroke-width": 2,
                                "stroke-dasharray": s.dash || "none"}, g);
      s.values.forEach(function (v, i) {
        if (v === null || v === undefined) return;
        const c = el("circle", {cx: xAt(i), cy: yAt(v), r: 3, fill: colour, "class": "pt",
                                "data-round": String(xs[i]), "data-value": String(v)}, g);
        hover(c, s.name + ", round " + xs[i] + ": " + (opts.fmt ? opts.fmt(v) : fmtNum(v, 4)));
      });
    });
    return svg;
  }

  // header and summary: what the run was (the model and data it used, its metrics, its mode)
  const cfg = D.config || {};
  const A = D.about, M = A.mode, TM = A.time;
  const XLABEL = M.name === "fedbuff" ? "record (one per applied buffer)" : "round";
  document.getElementById("title").textContent = "fedagg run report: " + D.run;
  const parts = [];
  if (cfg.run) parts.push(cfg.run.sites + " sites, " + cfg.run.rounds + (M.name === "fedbuff" ? " buffers" : " rounds"));
  if (A.data) parts.push("data " + A.data);
  if (A.model) parts.push("model " + A.model + (A.model_size ? " (" + A.model_size + ")" : ""));
  parts.push(M.text);
  if (cfg.strategy) parts.push("strategy " + cfg.strategy.name + (cfg.strategy.secure ? " (secure)" : ""));
  if (cfg.compression) parts.push("compression up " + cfg.compression.up + ", down " + cfg.compression.down);
  document.getElementById("subtitle").textContent = parts.join(" \u00b7 ");
  document.getElementById("provenance").textContent = "Model: " + (A.model_note || "unknown") +
    ". Data: " + (A.data_note || "unknown") + ".";
  const last = function (xs) { for (let i = xs.length - 1; i >= 0; i--) if (xs[i] !== null) return xs[i]; return null; };
  const T = D.traffic, LAB = A.metric_labels;
  const hasAcc = D.accuracy.some(function (v) { return v !== null; });
  const summary = document.getElementById("summary");
  const kv = [];
  if (hasAcc) kv.push(["final " + LAB.accuracy, fmtNum(last(D.accuracy), 4)]);
  kv.push(["final " + LAB.loss, fmtNum(last(D.loss), 4)]);
  if (M.name === "sync") kv.push(["rounds", String(Math.max(0, D.rounds.length - 1))]);
  else kv.push(["records / model versions", String(Math.max(0, D.rounds.length - 1)) + " / " + (M.versions === null ? "\u2013" : M.versions)]);
  kv.push(["mode", M.name === "sync" ? "synchronous" : M.name === "fedbuff" ? "FedBuff" : M.name]);
  if (M.name !== "sync") kv.push(["staleness mean / max", fmtNum(M.mean_staleness, 2) + " / " + (M.max_staleness === null ? "\u2013" : M.max_staleness)]);
  kv.push(["wall time", fmtNum(TM.wall, 1) + " s", TM.wall_how]);
  if (TM.startup !== null) kv.push(["engine start-up", fmtNum(TM.startup, 1) + " s", "round 0's seconds_startup: the simulation engine's start, before round 1"]);
  kv.push([M.name === "sync" ? "in rounds" : "in records", fmtNum(TM.rounds_total, 1) + " s", "the records' seconds summed (round 1 on)"]);
  if (TM.simulated !== undefined) kv.push(["simulated time", fmtNum(TM.simulated, 1) + " s", "the virtual clock of the simulated site speeds"]);
  kv.push(["bytes up (total)", fmtBytes(last(T.cum_up))], ["bytes down (total)", fmtBytes(last(T.cum_down))]);
  kv.push(["up vs dense fp32", T.ratio_up_total === null ? "\u2013" : fmtNum(T.ratio_up_total, 3) + "\u00d7"]);
  kv.forEach(function (item) {
    const d = h("div", {"data-key": item[0]}, item[0], summary);
    const b = h("b", null, item[1], d);
    if (item[2]) d.title = item[2];
  });

  const xs = D.rounds;
  const q = document.getElementById("quality");
  document.getElementById("quality-note").textContent = A.own_model ?
    "The central evaluation of the run (evaluate_fn) records two values, kept as 'loss' and 'accuracy' in metrics.json; they are named here as given to the report (metrics=...), else by their position." :
    "Central evaluation on the server's test split of the built-in data set.";
  const cap = function (t) { return t.charAt(0).toUpperCase() + t.slice(1); };
  if (hasAcc) chart(q, "accuracy", cap(LAB.accuracy) + " (central evaluation)", xs,
                    [{name: LAB.accuracy, key: "accuracy", values: D.accuracy}], A.accuracy_bounded ? {ymax: 1} : {});
  else h("div", {"class": "muted"}, "No central evaluation of a score in this run.", q);
  const lossSeries = [{name: LAB.loss, key: "loss", values: D.loss, colour: COLOURS[1]}];
  if (D.train_loss.some(function (v) { return v !== null; }))
    lossSeries.push({name: "train_loss (sites' training)", key: "train_loss", values: D.train_loss, colour: COLOURS[3], dash: "5 3"});
  chart(q, "loss", cap(LAB.loss) + " (central evaluation)", xs, lossSeries);

  const F = D.federated, fkeys = Object.keys(F.series);
  if (fkeys.length) {
    document.getElementById("federated-note").textContent = "The sites' evaluation of the global model on their own held-out data, averaged as recorded (federated_eval), under the metric names the sites report." +
      (F.dropped.length ? " Left out: " + F.dropped.join(", ") + " (0 in every round: not a classification)." : "");
    chart(document.getElementById("federated"), "federated", "Federated evaluation", F.rounds,
          fkeys.map(function (k, i) { return {name: k, values: F.series[k], colour: COLOURS[(i + 4) % COLOURS.length]}; }));
  } else {
    document.getElementById("federated-box").style.display = "none";
  }

  if (M.name !== "sync") {
    document.getElementById("async-note").textContent = M.text + "; staleness weighting " + (M.staleness || "?") +
      ". Staleness = model versions between the one a site trained from and the one its update was applied to.";
    chart(document.getElementById("async"), "staleness", "Staleness of the applied updates", M.xs,
          [{name: "updates applied", key: "updates", values: M.updates, kind: "bar", colour: "#adb5bd"},
           {name: "staleness_mean", values: M.staleness_mean, colour: COLOURS[2]},
           {name: "staleness_max", values: M.staleness_max, colour: COLOURS[6], dash: "5 3"}],
          {fmt: function (v) { return fmtNum(v, 1); }});
    chart(document.getElementById("async"), "versions", "Model version per record", M.xs,
          [{name: "version", values: M.version, colour: COLOURS[0]}], {fmt: function (v) { return fmtNum(v, 0); }});
  } else {
    document.getElementById("async-box").style.display = "none";
  }

  const tr = document.getElementById("traffic");
  const note = document.getElementById("traffic-note");
  note.textContent = T.params ? ("Dense fp32 reference: " + T.params + " parameters \u00d7 4 B = " +
    fmtBytes(T.dense_bytes_per_message) + " per message (up: per replying site, down: per sampled site). " +
    "Ratio = measured bytes / dense bytes (< 1: compressed).") :
    "No model.npz or checkpoint in the run directory: the dense fp32 reference is unknown.";
  chart(tr, "bytes", "Bytes per round", xs, [{name: "bytes_up", values: T.bytes_up, kind: "bar"},
    {name: "bytes_down", values: T.bytes_down, kind: "bar", colour: COLOURS[1]}], {fmt: fmtBytes});
  chart(tr, "cumulative", "Cumulative bytes", xs, [{name: "cum_up", values: T.cum_up},
    {name: "cum_down", values: T.cum_down, colour: COLOURS[1]}], {fmt: fmtBytes});
  if (T.ratio_up) chart(tr, "ratio", "Bytes / dense fp32", xs, [{name: "ratio_up", values: T.ratio_up},
    {name: "ratio_down", values: T.ratio_down, colour: COLOURS[1]}], {ymax: 1});

  const tm = document.getElementById("time");
  document.getElementById("time-note").textContent = (TM.startup !== null ?
    "The engine's start-up (" + fmtNum(TM.startup, 1) + " s, before round 1) is not a round and is not plotted. " : "") +
    "Wall time " + fmtNum(TM.wall, 1) + " s: " + TM.wall_how + ".";
  const phaseSeries = [{name: "seconds", values: D.seconds, colour: "#1d2330"}];
  Object.keys(D.phases).forEach(function (k, i) { phaseSeries.push({name: k, values: D.phases[k], colour: COLOURS[(i + 1) % COLOURS.length]}); });
  chart(tm, "phases", "Seconds per round and per phase", D.time_rounds, phaseSeries, {width: 600, fmt: function (v) { return fmtNum(v, 2); }});

  // site x round map
  const HM = D.heatmap, hm = document.getElementById("sites-map");
  if (HM.rows.length && HM.rounds.length) {
    const box = h("div", {"class": "chart"}, null, hm);
    const legend = h("div", {"class": "small"}, null, box);
    const STATE = {accepted: "#2b8a3e", absent: "#dee2e6", rejected: "#c92a2a", none: "#f8f9fa", unknown: "#adb5bd"};
    for (const s in STATE) { const sw = h("span", {"class": "swatch"}, null, legend); sw.style.background = STATE[s]; legend.appendChild(document.createTextNode(s)); }
    const cw = Math.max(10, Math.min(36, 640 / HM.rounds.length)), ch = 18, L = 104, Tp = 22;
    const svg = el("svg", {width: L + cw * HM.rounds.length + 10, height: Tp + ch * HM.rows.length + 40, "data-chart": "heatmap"}, box);
    HM.rows.forEach(function (r, i) {
      el("text", {x: L - 6, y: Tp + ch * i + 13, "text-anchor": "end", "font-size": 11}, svg).textContent = r;
    });
    const every = Math.max(1, Math.ceil(HM.rounds.length / 16));
    HM.rounds.forEach(function (r, j) {
      if (j % every === 0) el("text", {x: L + cw * j + cw / 2, y: Tp - 6, "text-anchor": "middle", "font-size": 10}, svg).textContent = String(r);
    });
    const col = {}; HM.rounds.forEach(function (r, j) { col[r] = j; });
    const row = {}; HM.rows.forEach(function (r, i) { row[r] = i; });
    for (const c of HM.cells) {
      const rect = el("rect", {x: L + cw * col[c.round] + 1, y: Tp + ch * row[c.row] + 1, width: cw - 2, height: ch - 2,
                               fill: STATE[c.state] || "#fff", "data-state": c.state, "data-row": c.row,
                               "data-round": String(c.round), "class": "cell"}, svg);
      hover(rect, c.title);
    }
    const y0 = Tp + ch * HM.rows.length + 14;
    el("text", {x: L - 6, y: y0, "text-anchor": "end", "font-size": 10, fill: "#5b6475"}, svg).textContent = "replied/sampled";
    HM.rounds.forEach(function (r, j) {
      if (j % every === 0) el("text", {x: L + cw * j + cw / 2, y: y0, "text-anchor": "middle", "font-size": 9, fill: "#5b6475"}, svg)
        .textContent = (HM.replied[j] === null ? "?" : HM.replied[j]) + "/" + (HM.sampled[j] === null ? "?" : HM.sampled[j]);
    });
  } else {
    h("div", {"class": "muted"}, "No training rounds recorded.", hm);
  }

  // intra-site training
  const S = D.sites, sc = document.getElementById("site-charts"), st = document.getElementById("site-table");
  const sn = document.getElementById("site-note");
  const algo = cfg.site ? cfg.site.algorithm : "?";
  sn.textContent = "Summed over the rounds each site took part in (site_metrics in metrics.json). Exposed communication = time the " +
    "training thread waited for all-reduce after backward; bus bandwidth = bytes all-reduced / time in all-reduce \u00d7 2(K-1)/K. " +
    "Configured all-reduce: site.algorithm = " + algo + ".";
  if (S.length) {
    const ids = S.map(function (s) { return "site " + s.site; });
    const box = h("div", {"class": "chart"}, null, sc);
    h("h3", null, "Compute vs exposed communication (s)", box);
    const W = 460, rowH = 20, L = 70;
    const svg = el("svg", {width: W, height: rowH * S.length + 10, "data-chart": "site-time"}, box);
    const tmax = Math.max(...S.map(function (s) { return s.compute_seconds + s.comm_wait_seconds; }), 1e-9);
    S.forEach(function (s, i) {
      el("text", {x: L - 6, y: rowH * i + 14, "text-anchor": "end", "font-size": 11}, svg).textContent = ids[i];
      const wc = (W - L - 80) * s.compute_seconds / tmax, ww = (W - L - 80) * s.comm_wait_seconds / tmax;
      hover(el("rect", {x: L, y: rowH * i + 3, width: Math.max(wc, 0.5), height: rowH - 6, fill: COLOURS[0],
                        "data-value": String(s.compute_seconds), "data-series": "compute_seconds", "data-site": s.site}, svg),
            ids[i] + ": compute " + fmtNum(s.compute_seconds, 3) + " s");
      hover(el("rect", {x: L + wc, y: rowH * i + 3, width: Math.max(ww, 0.5), height: rowH - 6, fill: COLOURS[1],
                        "data-value": String(s.comm_wait_seconds), "data-series": "comm_wait_seconds", "data-site": s.site}, svg),
            ids[i] + ": exposed communication " + fmtNum(s.comm_wait_seconds, 3) + " s");
      el("text", {x: L + wc + ww + 4, y: rowH * i + 14, "font-size": 10, fill: "#5b6475"}, svg).textContent =
        fmtNum(s.compute_seconds + s.comm_wait_seconds, 2) + " s";
    });
    const head = h("tr", null, null, h("thead", null, null, st));
    ["site", "rounds", "workers K", "examples", "compute s", "exposed comm s", "in all-reduce s", "bytes all-reduced", "bus bw GB/s", "all-reduce", "S(K) est."]
      .forEach(function (c) { h("th", null, c, head); });
    const body = h("tbody", null, null, st);
    for (const s of S) {
      const r = h("tr", {"data-site": s.site}, null, body);
      [s.site, s.rounds, s.workers, fmtNum(s.num_examples, 0), fmtNum(s.compute_seconds, 3), fmtNum(s.comm_wait_seconds, 3),
       fmtNum(s.comm_seconds, 3), fmtBytes(s.bytes_allreduced), s.busbw_gb_s === null ? "\u2013" : fmtNum(s.busbw_gb_s, 3),
       s.algorithms.length ? s.algorithms.join(", ") : "\u2013", s.scaling_est === null ? "\u2013" : fmtNum(s.scaling_est, 2)]
        .forEach(function (v) { h("td", null, String(v), r); });
    }
  } else {
    h("div", {"class": "muted"}, "No per-site metrics in this run.", sc);
  }

  // secure aggregation
  const SA = D.secagg, sa = document.getElementById("secagg");
  if (SA.keys.length) {
    const charts = h("div", {"class": "charts"}, null, sa);
    const shown = SA.keys.filter(function (k) { return /counted|dropped|recovered|survivors/.test(k); });
    chart(charts, "secagg", "Sites counted / dropped per round", SA.rounds,
          (shown.length ? shown : SA.keys).map(function (k, i) { return {name: k, values: SA.values[k], kind: "bar", colour: COLOURS[(i + 2) % COLOURS.length]}; }),
          {fmt: function (v) { return fmtNum(v, 0); }});
    const t = h("table", null, null, sa), hr = h("tr", null, null, h("thead", null, null, t));
    h("th", null, "round", hr); SA.keys.forEach(function (k) { h("th", null, k, hr); });
    const tb = h("tbody", null, null, t);
    SA.rounds.forEach(function (r, i) {
      const row = h("tr", null, null, tb); h("td", null, String(r), row);
      SA.keys.forEach(function (k) { h("td", null, fmtNum(SA.values[k][i], 4), row); });
    });
  } else {
    h("div", {"class": "muted"}, "Secure aggregation was not used in this run (no secagg_* keys).", sa);
  }
  // distributed differential privacy: epsilon spent per round
  const PV = D.privacy, pv = document.getElementById("privacy");
  if (PV.rounds.length) {
    const charts = h("div", {"class": "charts"}, null, pv);
    chart(charts, "privacy", "Epsilon spent so far (delta " + fmtNum(PV.delta, 6) + ")", PV.rounds,
          [{name: "epsilon", values: PV.epsilon, kind: "line", colour: COLOURS[3 % COLOURS.length]}],
          {fmt: function (v) { return fmtNum(v, 3); }});
    h("div", {"class": "muted"}, "Distributed DP under secure aggregation: each site's noise share " +
      "in the secure sum; noise std per coordinate of the mean " + fmtNum(PV.noise_std, 4) +
      " (model units), " + fmtNum(PV.ring_bits, 0) + "-bit ring." +
      (PV.stopped ? " The run stopped: " + PV.stopped : ""), pv);
  } else {
    h("div", {"class": "muted"}, "No differential privacy in this run (no privacy_* keys).", pv);
  }
  document.getElementById("config").textContent = JSON.stringify(cfg, null, 2);
  document.body.dataset.ready = "1";
})();
"""
