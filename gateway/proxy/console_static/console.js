// The operator console's only script: polls the history of the selected region and draws
// it as inline SVG (a chart per rule, a health strip per counter store), switches region
// and filters rules without a reload, and sends the explain form as JSON (never in the
// URL). Served from the package; no external code, no library. Under the console's CSP
// (script-src 'self', style-src 'self'): no inline style, only classes and SVG attributes.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 3000;
const CHART = { width: 240, height: 34, top: 11 };  // bars between top and height
const STRIP = { width: 240, height: 12 };
const STRIP_CLASSES = { u: "up", d: "down", p: "partly", "-": "unknown" };

const state = { region: "", filter: "", history: null, timer: 0 };
const charts = new Map();  // rule id -> the data its chart was last drawn from

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function rate(value) {
  return value === null || value === undefined ? "-" : value.toFixed(2);
}

function clock(epoch) {
  return new Date(epoch * 1000).toISOString().slice(11, 19);
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) throw new Error(path + ": " + response.status);
  return response.json();
}

// --- charts ------------------------------------------------------------------------------

function peak(values) {
  return values.reduce((m, v) => (v > m ? v : m), 0);
}

// A row's series, one rate per bucket; the server leaves out a series that is all zero.
function series(row, name, n) {
  return row[name] || new Array(n).fill(0);
}

function summary(row) {
  if (row.idle) return row.rule + ": no requests in the last 10 minutes";
  const now = row.now;
  let text = row.rule + ": over the last 10 minutes, peak " + rate(peak(row.allowed || [])) +
    " allowed and " + rate(peak(row.limited || [])) + " limited per second; last minute " +
    rate(now.allowed) + " allowed, " + rate(now.limited) + " limited per second";
  if (row.total.shadow) text += ", " + rate(now.shadow) + " shadow-limited";
  return text;
}

function barPath(x0, width, values, base, scale, plot) {
  // one path of rectangles: cheaper for the page than one element per bar
  let d = "";
  values.forEach((v, i) => {
    if (!v) return;
    const h = Math.max(1, (v / scale) * plot);
    const bottom = base[i];
    d += "M" + (x0 + i * width).toFixed(1) + " " + bottom.toFixed(1) + "v" + (-h).toFixed(1) +
      "h" + (width - 1).toFixed(1) + "v" + h.toFixed(1) + "z";
    base[i] = bottom - h;
  });
  return d;
}

function drawChart(svg, row, history) {
  const n = history.covered.length;
  const slot = CHART.width / n;
  const plot = CHART.height - CHART.top;
  svg.replaceChildren();
  svg.setAttribute("aria-label", summary(row));
  svg.setAttribute("tabindex", row.idle ? "-1" : "0");  // nothing to read out of an idle one
  svg.append(el("title", {}, summary(row)));
  svg.append(el("rect", { x: 0, y: CHART.top, width: CHART.width, height: plot, class: "plot" }));
  svg.append(el("line", { x1: 0, x2: CHART.width, y1: CHART.height - 0.5, y2: CHART.height - 0.5, class: "axis" }));
  history.covered.forEach((c, i) => {
    if (c <= 0) svg.append(el("rect", { x: i * slot, y: CHART.height - 3, width: slot - 1, height: 3, class: "nodata" }));
  });
  if (row.idle) {
    svg.append(el("text", { x: 2, y: 9, class: "label" }, "idle"));
    return;
  }
  const allowed = series(row, "allowed", n);
  const limited = series(row, "limited", n);
  const shadow = series(row, "shadow", n);
  const stacked = allowed.map((a, i) => a + limited[i]);
  const scale = Math.max(peak(stacked), peak(shadow), 0.1);
  const base = new Array(n).fill(CHART.height);
  svg.append(el("path", { d: barPath(0, slot, allowed, base, scale, plot), class: "allowed" }));
  svg.append(el("path", { d: barPath(0, slot, limited, base, scale, plot), class: "limited" }));
  if (row.shadow) {
    const points = shadow.map((v, i) =>
      ((i + 0.5) * slot).toFixed(1) + "," + (CHART.height - ((v || 0) / scale) * plot).toFixed(1));
    svg.append(el("polyline", { points: points.join(" "), class: "shadow" }));
  }
  const cursor = svg.dataset.cursor;
  if (cursor !== undefined) {
    const i = Number(cursor);
    svg.append(el("rect", { x: i * slot - 0.5, y: CHART.top - 1, width: slot, height: plot + 1, class: "cursor" }));
    const at = clock(history.start + i * history.bucket_s);
    const label = history.covered[i] > 0
      ? at + "  " + rate(allowed[i]) + " allowed, " + rate(limited[i]) + " limited /s"
      : at + "  no data";
    svg.append(el("text", { x: 2, y: 9, class: "label" }, label));
  } else {
    svg.append(el("text", { x: 2, y: 9, class: "label" }, "peak " + rate(scale) + "/s"));
  }
}

function moveCursor(svg, index) {
  const rule = svg.dataset.rule;
  const row = charts.get(rule);
  const history = state.history;
  if (!row || !history || row.idle) return;
  const n = history.covered.length;
  const i = Math.min(n - 1, Math.max(0, index));
  svg.dataset.cursor = String(i);
  drawChart(svg, row, history);
  const at = clock(history.start + i * history.bucket_s);
  const [allowed, limited, shadow] = ["allowed", "limited", "shadow"].map((s) => series(row, s, n));
  document.getElementById("chart-status").textContent = history.covered[i] > 0
    ? rule + " at " + at + " UTC: " + rate(allowed[i]) + " allowed, " + rate(limited[i]) +
      " limited, " + rate(shadow[i]) + " shadow-limited per second"
    : rule + " at " + at + " UTC: not sampled";
}

function clearCursor(svg) {
  if (svg.dataset.cursor === undefined) return;
  delete svg.dataset.cursor;
  const row = charts.get(svg.dataset.rule);
  if (row && state.history) drawChart(svg, row, state.history);
}

function chartKeys(event) {
  const svg = event.currentTarget;
  const n = state.history ? state.history.covered.length : 0;
  const at = svg.dataset.cursor === undefined ? n - 1 : Number(svg.dataset.cursor);
  const moves = { ArrowLeft: at - 1, ArrowRight: at + 1, Home: 0, End: n - 1, PageUp: at - 6, PageDown: at + 6 };
  if (event.key === "Escape") { clearCursor(svg); return; }
  if (!(event.key in moves)) return;
  event.preventDefault();
  moveCursor(svg, moves[event.key]);
}

function chartPointer(event) {
  const svg = event.currentTarget;
  const box = svg.getBoundingClientRect();
  const n = state.history ? state.history.covered.length : 1;
  moveCursor(svg, Math.floor(((event.clientX - box.left) / box.width) * n));
}

function newChart(rule) {
  const svg = el("svg", {
    width: CHART.width, height: CHART.height, viewBox: "0 0 " + CHART.width + " " + CHART.height,
    role: "img", class: "chart",
  });
  svg.dataset.rule = rule;
  svg.addEventListener("keydown", chartKeys);
  svg.addEventListener("mousemove", chartPointer);
  svg.addEventListener("mouseleave", () => clearCursor(svg));
  svg.addEventListener("blur", () => clearCursor(svg));
  return svg;
}

function table() {
  return document.querySelector('table.rules[data-region="' + CSS.escape(state.region) + '"]');
}

function rowFor(rules, rule) {
  let tr = rules.querySelector('tr[data-rule="' + CSS.escape(rule) + '"]');
  if (tr) return tr;
  // counts for a rule the loaded table does not have (removed by a reload; "-": no rule)
  tr = document.createElement("tr");
  tr.dataset.rule = rule;
  tr.className = "extra";
  const details = cell(rule === "-" ? "requests no rule matched" : "not in the loaded table");
  details.colSpan = 5;
  tr.append(cell(""), cell(rule), details, cell("-", "num allowed"), cell("-", "num limited"),
            cell("", "chart"), cell("", "file"));
  rules.tBodies[0].append(tr);
  applyFilter();
  return tr;
}

function setRate(td, value) {
  td.textContent = rate(value);
  td.classList.toggle("zero", !value);
}

function drawRules(history) {
  const rules = table();
  if (!rules) return;
  const drawn = new Set();
  for (const row of history.rules) {
    const tr = rowFor(rules, row.rule);
    const now = row.now || { allowed: 0, limited: 0 };
    setRate(tr.querySelector("td.allowed"), now.allowed);
    setRate(tr.querySelector("td.limited"), now.limited);
    const target = tr.querySelector("td.chart");
    let svg = target.querySelector("svg");
    if (!svg) {
      svg = newChart(row.rule);
      target.replaceChildren(svg);
    }
    charts.set(row.rule, row);
    drawChart(svg, row, history);  // in place: a focused chart keeps its focus
    drawn.add(row.rule);
  }
  // rows the bounded answer left out: no stale chart from another filter
  for (const tr of rules.tBodies[0].rows) {
    if (drawn.has(tr.dataset.rule)) continue;
    tr.querySelector("td.chart").replaceChildren();
    setRate(tr.querySelector("td.allowed"), null);
    setRate(tr.querySelector("td.limited"), null);
  }
  const note = document.getElementById("rules-note");
  note.textContent = history.rules_omitted
    ? "charts for the first " + history.rules.length + " of " + history.rules_matching +
      " matching rules: narrow the filter to chart the others"
    : "";
}

// --- counter stores and identities -------------------------------------------------------

function drawStrip(td, region, states, history) {
  const slot = STRIP.width / states.length;
  const svg = el("svg", {
    width: STRIP.width, height: STRIP.height, viewBox: "0 0 " + STRIP.width + " " + STRIP.height,
    role: "img", class: "strip",
  });
  const down = [...states].filter((s) => s === "d" || s === "p").length;
  const checked = [...states].filter((s) => s !== "-").length;
  const lastDown = states.lastIndexOf("d") >= 0 ? states.lastIndexOf("d") : states.lastIndexOf("p");
  const label = region + ": counter store " + (down
    ? "failed checks in " + down + " of " + checked + " checked 10-second intervals, last at " +
      clock(history.start + lastDown * history.bucket_s) + " UTC"
    : checked ? "answered every check in the last 10 minutes" : "not checked yet");
  svg.setAttribute("aria-label", label);
  svg.append(el("title", {}, label));
  [...states].forEach((s, i) => {
    svg.append(el("rect", { x: i * slot, y: 0, width: slot - 0.5, height: STRIP.height, class: STRIP_CLASSES[s] || "unknown" }));
  });
  td.replaceChildren(svg);
  td.dataset.states = states;
  // the health column: the latest check, as the strip has it
  const latest = [...states].reverse().find((s) => s !== "-");
  const now = td.parentElement.querySelector("td.health");
  if (latest && now) {
    now.textContent = latest === "u" ? "healthy" : latest === "d" ? "NOT ANSWERING" : "unsteady";
    now.className = "health " + (latest === "u" ? "ok" : latest === "d" ? "bad" : "warn");
  }
}

function drawHealth(history) {
  for (const h of history.health) {
    const tr = document.querySelector('#regions tr[data-region="' + CSS.escape(h.region) + '"]');
    if (tr) drawStrip(tr.querySelector("td.strip"), h.region, h.states, history);
  }
}

function drawTop(history) {
  const body = document.querySelector("#top-limited tbody");
  const rows = history.top_limited.map((t) => {
    const tr = document.createElement("tr");
    const who = document.createElement("td");
    const code = document.createElement("code");
    code.className = "id";
    code.textContent = t.identity;
    who.append(code);
    tr.append(who, cell(t.consumer || "-"), cell(t.tier || "-"),
              cell(t.refusals.toLocaleString("en"), "num"), cell(t.rules.join(", ")),
              cell(clock(t.last)));
    return tr;
  });
  if (!rows.length) {
    const td = cell("none in the last 10 minutes");
    td.colSpan = 6;
    const tr = document.createElement("tr");
    tr.append(td);
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

// --- polling, region and filter ------------------------------------------------------------

async function refresh() {
  if (document.hidden) return;
  const query = "?region=" + encodeURIComponent(state.region) +
    (state.filter ? "&rule=" + encodeURIComponent(state.filter) : "");
  try {
    const history = await getJSON("/console/api/history" + query);
    if (history.region !== state.region) return;  // switched meanwhile
    state.history = history;
    drawRules(history);
    drawHealth(history);
    drawTop(history);
    document.body.dataset.refreshed = String(Date.now());
    delete document.body.dataset.error;
  } catch (err) {
    document.body.dataset.error = String(err);
  }
}

function schedule(delay) {
  clearTimeout(state.timer);
  state.timer = setTimeout(async () => {
    await refresh();
    schedule(POLL_MS);
  }, delay);
}

function remember() {
  const params = new URLSearchParams({ region: state.region });
  if (state.filter) params.set("rule", state.filter);
  history.replaceState(null, "", "/console?" + params.toString());
}

function selectRegion(region) {
  state.region = region;
  charts.clear();
  for (const t of document.querySelectorAll("table.rules")) t.hidden = t.dataset.region !== region;
  for (const s of document.querySelectorAll(".region-name")) s.textContent = region;
  document.querySelector('#explain select[name="region"]').value = region;
  applyFilter();
  remember();
  schedule(0);
}

function applyFilter() {
  const wanted = state.filter.toLowerCase();
  const rules = table();
  if (!rules) return;
  let shown = 0;
  const rows = rules.tBodies[0].rows;
  for (const tr of rows) {
    tr.hidden = Boolean(wanted) && !tr.dataset.rule.toLowerCase().includes(wanted);
    if (!tr.hidden) shown += 1;
  }
  document.getElementById("filter-count").textContent =
    wanted ? shown + " of " + rows.length + " rules" : "";
}

function setFilter(value) {
  state.filter = value.trim().slice(0, 200);
  applyFilter();
  remember();
  schedule(300);  // typing: one request once it pauses
}

async function explain(event) {
  event.preventDefault();
  const form = event.target;
  const answer = document.getElementById("explain-answer");
  const payload = Object.fromEntries(new FormData(form).entries());
  const response = await fetch("/console/api/explain", {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(payload),
  });
  const data = await response.json();
  answer.textContent = response.ok ? data.text : "error: " + data.detail;
  answer.className = response.ok ? "" : "error";
}

document.addEventListener("DOMContentLoaded", () => {
  document.documentElement.classList.add("js");
  const select = document.getElementById("region");
  const filter = document.getElementById("rule-filter");
  state.region = select.value;
  state.filter = filter.value.trim();
  select.addEventListener("change", () => selectRegion(select.value));
  filter.addEventListener("input", () => setFilter(filter.value));
  // with the script the form applies in place (Enter in the filter included)
  document.getElementById("view").addEventListener("submit", (event) => {
    event.preventDefault();
    setFilter(filter.value);
  });
  document.addEventListener("keydown", (event) => {
    const typing = event.target.closest("input, textarea, select");
    if (event.key === "/" && !typing) {  // "/" jumps to the rule filter
      event.preventDefault();
      filter.focus();
    }
  });
  document.getElementById("explain").addEventListener("submit", explain);
  applyFilter();
  document.addEventListener("visibilitychange", () => { if (!document.hidden) schedule(0); });
  schedule(0);
});
