// The console's own script: follows a job's log, draws its training curves, and draws the
// simulator's plots. Everything else is htmx attributes in the pages.
"use strict";

const POLL_MS = 1500;

async function getJSON(url, options) {
  const response = await fetch(url, { credentials: "same-origin", ...options });
  if (response.status === 303 || response.redirected) { window.location.assign(response.url); }
  if (!response.ok) { throw new Error(`${url}: ${response.status}`); }
  return response.json();
}

// A job's log, appended as it is written, until the job has ended and nothing is left.
function followLog(pre) {
  let offset = 0;
  const step = async () => {
    let chunk;
    try {
      chunk = await getJSON(`${pre.dataset.log}?offset=${offset}`);
    } catch (e) {
      setTimeout(step, POLL_MS * 2);
      return;
    }
    if (chunk.text) {
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.append(chunk.text);
      if (atEnd) { pre.scrollTop = pre.scrollHeight; }
    }
    offset = chunk.offset;
    if (chunk.more) { setTimeout(step, chunk.text ? 0 : POLL_MS); }
    else { pre.dataset.done = "true"; }
  };
  step();
}

// One uPlot line chart in `el`, resized with it. `series` is [{label, stroke}].
function lineChart(el, xLabel, series, data) {
  const options = {
    width: Math.max(el.clientWidth, 200), height: 220,
    scales: { x: { time: false } },
    axes: [{ label: xLabel }, {}],
    series: [{ label: xLabel }, ...series.map((s) => ({ width: 2, spanGaps: true, ...s }))],
  };
  const chart = new uPlot(options, data, el);
  new ResizeObserver(() => chart.setSize({ width: Math.max(el.clientWidth, 200), height: 220 }))
    .observe(el);
  return chart;
}

// A job's loss, throughput and gradient-norm curves, refreshed until the job has ended.
function followCurves(box) {
  const charts = {};
  const step = async () => {
    let curves;
    try {
      curves = await getJSON(box.dataset.curves);
    } catch (e) {
      setTimeout(step, POLL_MS * 2);
      return;
    }
    if (curves.step.length) {
      box.classList.add("has-data");
      for (const el of box.querySelectorAll(".chart")) {
        const name = el.dataset.series;
        const data = [curves.step, curves.series[name]];
        if (charts[name]) { charts[name].setData(data); }
        else { charts[name] = lineChart(el, "step", [{ label: name, stroke: "#0b5cad" }], data); }
        el.dataset.points = String(curves.step.length);
      }
    }
    if (!curves.done) { setTimeout(step, POLL_MS); }
    else { box.dataset.done = "true"; }
  };
  step();
}

const PALETTE = ["#0b5cad", "#b42318", "#1a7f37", "#8250df", "#9a6700", "#0e7490", "#be185d"];

// The simulator's results: one JCT CDF and one utilisation curve per policy.
function drawSimulation(result) {
  const cdf = document.getElementById("sim-cdf");
  const util = document.getElementById("sim-util");
  cdf.replaceChildren(); util.replaceChildren();
  const series = result.policies.map((p, i) => ({ label: p.policy, stroke: PALETTE[i % PALETTE.length] }));
  lineChart(cdf, "JCT (hours)", series, result.cdf);
  lineChart(util, "time (hours)", series, result.utilisation);
}

function setUp(root) {
  for (const pre of root.querySelectorAll("pre[data-log]:not([data-started])")) {
    pre.dataset.started = "true"; followLog(pre);
  }
  for (const box of root.querySelectorAll("[data-curves]:not([data-started])")) {
    box.dataset.started = "true"; followCurves(box);
  }
  const sim = root.querySelector("#sim-form:not([data-started])");
  if (sim) {
    sim.dataset.started = "true";
    sim.addEventListener("submit", async (event) => {
      event.preventDefault();
      const status = document.getElementById("sim-status");
      status.textContent = "Simulating…";
      const file = sim.querySelector("#sim-trace").files[0];
      const params = new URLSearchParams();
      for (const box of sim.querySelectorAll("input[name=policy]:checked")) { params.append("policy", box.value); }
      params.set("example", sim.querySelector("#sim-example").value);
      params.set("cluster", sim.querySelector("#sim-cluster").value);
      const response = await fetch(`${sim.action}?${params}`, {
        method: "POST", credentials: "same-origin", body: file || "",
        headers: { "Content-Type": "text/csv" },
      });
      const body = await response.json();
      if (!response.ok) { status.textContent = body.detail; return; }
      status.textContent = "";
      document.getElementById("sim-table").innerHTML = body.table;
      drawSimulation(body);
    });
  }
}

document.addEventListener("DOMContentLoaded", () => setUp(document));
