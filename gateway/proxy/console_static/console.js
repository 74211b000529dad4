// The operator console's only script: refreshes rates and recent refusals, sends the
// explain form as JSON (never in the URL). Served from the package; no external code.
"use strict";

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) throw new Error(path + ": " + response.status);
  return response.json();
}

async function refreshRates() {
  const data = await getJSON("/console/api/rates");
  const body = document.querySelector("#rates tbody");
  const rows = data.rates.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.rule = r.rule;
    tr.append(
      cell(r.region), cell(r.rule),
      cell(r.allowed_60s.toFixed(2), "allowed"),
      cell(r.limited_60s.toFixed(2), "limited"),
      cell(r.shadow_limited_60s.toFixed(2), "shadow"),
      cell(Math.round(r.allowed_total || 0).toLocaleString("en")),
      cell(Math.round(r.limited_total || 0).toLocaleString("en")),
      cell(Math.round(r.shadow_limited_total || 0).toLocaleString("en")),
    );
    return tr;
  });
  body.replaceChildren(...rows);
}

async function refreshRecent() {
  const recent = await getJSON("/console/api/recent");
  const body = document.querySelector("#recent tbody");
  if (!recent.length) return;
  body.replaceChildren(...recent.map((r) => {
    const tr = document.createElement("tr");
    const when = new Date(r.time * 1000).toISOString().slice(11, 19);
    tr.append(cell(when), cell(r.region), cell(r.rule || "-"), cell(r.identity || "-", "id"),
              cell(String(r.refusals)));
    return tr;
  }));
}

async function refresh() {
  try {
    await Promise.all([refreshRates(), refreshRecent()]);
    document.body.dataset.refreshed = String(Date.now());
  } catch (err) {
    document.body.dataset.error = String(err);
  }
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
  document.getElementById("explain").addEventListener("submit", explain);
  refresh();
  setInterval(refresh, 2000);
});
