"""The dashboard's one page: HTML with inline CSS and JS, no build step, no external assets.

It polls ``/api/cluster`` every 0.5 s and renders the workers, the jobs with a progress bar,
their recoveries, each job's timeline and its metric curves (the SVGs the server drew). Text from the cluster
goes into the page only through ``textContent`` and ``setAttribute`` (never as markup); the
exceptions are the timeline and metric SVGs, which :func:`rallypoint.orchestrator.observe.timeline_svg.timeline_svg`
and :func:`rallypoint.orchestrator.observe.metrics_svg.metrics_svg` build with every text escaped. Elements carry stable ids and ``data-*`` attributes
(``data-worker``, ``data-state``, ``data-job``, ``data-step``, ``data-steps``,
``data-recoveries``, ``data-recovery``) for tests and scripts.
"""

from __future__ import annotations

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Rallypoint dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font-family:sans-serif;margin:1em 1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;font-size:.9em}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
.bar{width:160px;height:12px;background:#eee;border:1px solid #bbb;display:inline-block;vertical-align:middle}
.bar>span{display:block;height:100%;background:#2a7fbf}
.state-lost,.state-failed{color:#c00;font-weight:bold}
.state-recovering,.state-leaving,.state-cordoned{color:#b36b00;font-weight:bold}
.state-succeeded,.state-running,.state-leased{color:#2a7f2a}
.state-spare{color:#555}
#banner{padding:.4em .8em;background:#fff4d6;border:1px solid #e0c070;margin:.5em 0}
#banner:empty{display:none}
#status{color:#777;font-size:.85em}
.timeline svg,.metrics svg{max-width:100%;height:auto;border:1px solid #eee}
.recovery{font-size:.85em;margin:.1em 0}
</style></head>
<body data-polls="0">
<h1>Rallypoint <span id="cluster"></span></h1>
<div id="leader"></div>
<div id="banner"></div>
<div id="status">loading...</div>
<h2>Workers</h2>
<table id="workers-table"><thead><tr><th>worker</th><th>state</th><th>incarnation</th><th>devices</th>
<th>free</th><th>cordoned</th><th>held by</th><th>pid</th></tr></thead><tbody id="workers"></tbody></table>
<h2>Jobs</h2>
<table id="jobs-table"><thead><tr><th>job</th><th>state</th><th>priority</th><th>progress</th><th>steps/s</th>
<th>devices</th><th>recoveries</th><th>drains</th><th>failures</th></tr></thead><tbody id="jobs"></tbody></table>
<div id="recoveries"></div>
<h2>Timeline</h2>
<div id="timelines"></div>
<h2>Metrics</h2>
<div id="metrics"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function row(attrs, cells) {
  const tr = el("tr", attrs);
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", {}, c));
  return tr;
}
function stateCell(s) { return el("td", {"class": "state-" + String(s).replace(/[^a-z_]/g, "")}, s); }
function fmt(v, digits) { return (v === null || v === undefined) ? "-" : Number(v).toFixed(digits); }
function safeUrl(u) { return (typeof u === "string" && /^https?:\\/\\//.test(u)) ? u : null; }

function renderLeader(d) {
  $("cluster").textContent = "cluster " + d.cluster;
  const L = d.leader;
  const lead = L ? L.coordinator + " (term " + L.term + ")" : "none";
  $("leader").textContent = "coordinator " + d.coordinator + (d.leading ? " leads" : " stands by") +
    "; leader " + lead;
  $("leader").dataset.leading = d.leading ? "true" : "false";
  const banner = $("banner");
  banner.textContent = "";
  if (!d.leading) {
    banner.appendChild(document.createTextNode("This coordinator does not lead. "));
    const url = L ? safeUrl(L.dashboard) : null;
    if (url) {
      banner.appendChild(document.createTextNode("The leader " + L.coordinator + " serves the live view at "));
      banner.appendChild(el("a", {"href": url, "id": "leader-link"}, url));
    } else {
      banner.appendChild(document.createTextNode(L ? "The leader is " + L.coordinator + "." : "No leader now."));
    }
  }
  if (d.error) banner.appendChild(el("div", {}, d.error));
}

function renderWorkers(workers) {
  const body = el("tbody", {"id": "workers"});
  for (const w of workers) {
    const held = w.held_by.map((h) => h.job + "/" + h.slice).join(", ") || "-";
    const state = w.state + (w.lost_reason ? " (" + w.lost_reason + ")" : "");
    const s = stateCell(w.state);
    s.textContent = state;
    body.appendChild(row({"data-worker": w.worker, "data-state": w.state, "data-incarnation": w.incarnation},
      [w.worker, s, w.incarnation, w.devices, w.free, w.cordoned ? "yes" : "no", held, w.pid]));
  }
  $("workers").replaceWith(body);
}

function renderJobs(jobs) {
  const body = el("tbody", {"id": "jobs"});
  const recs = el("div", {"id": "recoveries"});
  const timelines = el("div", {"id": "timelines"});
  const metrics = el("div", {"id": "metrics"});
  for (const j of jobs) {
    const pct = j.steps ? Math.min(100, 100 * j.step_done / j.steps) : 0;
    const bar = el("td", {"class": "progress"});
    const outer = el("span", {"class": "bar", "title": pct.toFixed(0) + "%"});
    outer.appendChild(el("span", {"style": "width:" + pct.toFixed(1) + "%"}));
    bar.appendChild(outer);
    bar.appendChild(el("span", {"class": "steps"}, " " + j.step_done + "/" + j.steps));
    const last = j.recoveries.length ? j.recoveries[j.recoveries.length - 1] : null;
    const recText = j.recoveries.length + (last ? " (last MTTR " + fmt(last.mttr_s, 3) + "s)" : "");
    body.appendChild(row({"data-job": j.job, "data-state": j.state, "data-step": j.step_done,
                          "data-steps": j.steps, "data-recoveries": j.recoveries.length},
      [j.job, stateCell(j.state), j.priority, bar, fmt(j.steps_per_s, 2), j.devices_held, recText,
       j.drains.length, j.failures.length]));
    for (const r of j.recoveries) {
      const phases = Object.entries(r.phases || {}).map(([k, v]) => k + " " + fmt(v, 3) + "s").join(", ");
      const lost = Object.keys(r.lost || {}).join(", ");
      recs.appendChild(el("div", {"class": "recovery", "data-job": j.job, "data-recovery": r.recovery,
                                  "data-mttr": r.mttr_s === null || r.mttr_s === undefined ? "" : r.mttr_s},
        j.job + ": recovery " + r.recovery + " of " + (lost || "?") + " from step " +
        (r.checkpoint_step === undefined ? "?" : r.checkpoint_step) + ": " + (phases || "in progress") +
        "; MTTR " + fmt(r.mttr_s, 3) + "s"));
    }
    if (j.timeline_svg) {
      const box = el("div", {"class": "timeline", "data-job": j.job});
      box.appendChild(el("h3", {}, j.job));
      const svg = el("div", {});
      svg.innerHTML = j.timeline_svg;  /* drawn by the server, every text escaped (timeline_svg.py) */
      box.appendChild(svg);
      timelines.appendChild(box);
    }
    if (j.metrics_svg) {
      const names = Object.keys(j.metrics || {});
      const box = el("div", {"class": "metrics", "data-job": j.job, "data-metrics": names.join(","),
                             "data-points": names.length ? (j.metrics[names[0]] || []).length : 0});
      box.appendChild(el("h3", {}, j.job));
      const svg = el("div", {});
      svg.innerHTML = j.metrics_svg;  /* drawn by the server, every text escaped (metrics_svg.py) */
      box.appendChild(svg);
      metrics.appendChild(box);
    }
  }
  $("jobs").replaceWith(body);
  $("recoveries").replaceWith(recs);
  $("timelines").replaceWith(timelines);
  $("metrics").replaceWith(metrics);
}

let polls = 0;
async function poll() {
  try {
    const r = await fetch("/api/cluster", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const d = await r.json();
    renderLeader(d);
    renderWorkers(d.workers);
    renderJobs(d.jobs);
    polls += 1;
    document.body.dataset.polls = String(polls);
    $("status").textContent = "updated " + new Date(d.now * 1000).toLocaleTimeString();
  } catch (e) {
    $("status").textContent = "cannot reach the coordinator: " + e;
  }
  setTimeout(poll, 500);
}
poll();
</script>
</body></html>
"""
