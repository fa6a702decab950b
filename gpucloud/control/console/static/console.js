// The console's own script: follows a job's log, draws its training curves, the
// deployments' traffic, a deployment's split over time, the month's usage and the
// simulator's plots. Everything else is
// htmx attributes in the pages.
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

// One uPlot line chart in `el`, resized with it. `series` is [{label, stroke}]; `time`:
// x holds epoch seconds; `yRange`: [min, max] of the y axis, else fitted to the data.
function lineChart(el, xLabel, series, data, time = false, yRange = null) {
  const options = {
    width: Math.max(el.clientWidth, 200), height: 220,
    scales: { x: { time }, y: yRange ? { auto: false, range: yRange } : {} },
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

// A titled group of charts, found by `key` in `box` or added to it: [section, {name: div}].
function chartGroup(box, key, title, figures) {
  let section = box.querySelector(`section[data-key="${CSS.escape(key)}"]`);
  if (!section) {
    section = document.createElement("section");
    section.dataset.key = key;
    const heading = document.createElement("h3");
    heading.textContent = title;
    const grid = document.createElement("div");
    grid.className = "charts";
    for (const [name, caption] of figures) {
      const figure = document.createElement("figure");
      const label = document.createElement("figcaption");
      label.id = `${box.id}-${key}-${name}`;
      label.textContent = caption;
      const chart = document.createElement("div");
      chart.className = "chart";
      chart.dataset.chart = name;
      chart.setAttribute("role", "img");
      chart.setAttribute("aria-labelledby", label.id);
      figure.append(label, chart);
      grid.append(figure);
    }
    section.append(heading, grid);
    box.append(section);
  }
  const charts = {};
  for (const el of section.querySelectorAll(".chart")) { charts[el.dataset.chart] = el; }
  return [section, charts];
}

// Draw `data` in `el`, reusing its chart while the series stay the same.
function draw(el, xLabel, series, data, time = false, yRange = null) {
  const shape = JSON.stringify(series.map((s) => s.label));
  if (el.chart && el.dataset.shape === shape) { el.chart.setData(data); return; }
  el.replaceChildren();
  el.chart = lineChart(el, xLabel, series, data, time, yRange);
  el.dataset.shape = shape;
}

const PERCENTILES = [["p50", "#1a7f37"], ["p90", "#9a6700"], ["p99", "#b42318"]];
const ms = (values) => values.map((v) => (v === null ? null : v * 1000));

// Each deployment's request rate and errors, TTFT and TPOT percentiles, polled.
function followTraffic(box) {
  const step = async () => {
    let body;
    try {
      body = await getJSON(box.dataset.series);
    } catch (e) {
      setTimeout(step, POLL_MS * 4);
      return;
    }
    for (const d of body.deployments) {
      const [section, charts] = chartGroup(box, String(d.id), `${d.name} (${d.tenant})`, [
        ["rate", `${d.name}: requests and errors per second`],
        ["ttft", `${d.name}: time to first token (ms)`],
        ["tpot", `${d.name}: time per output token (ms)`],
      ]);
      section.dataset.deployment = d.name;
      section.dataset.points = String(d.at.length);
      if (!d.at.length) { continue; }
      box.classList.add("has-data");
      draw(charts.rate, "time", [{ label: "requests/s", stroke: "#0b5cad" },
        { label: "errors/s", stroke: "#b42318" }], [d.at, d.requests_per_s, d.errors_per_s], true);
      for (const kind of ["ttft", "tpot"]) {
        const series = PERCENTILES.map(([p, stroke]) => ({ label: p, stroke }));
        const data = [d.at, ...PERCENTILES.map(([p]) => ms(d[`${kind}_${p}`]))];
        draw(charts[kind], "time", series, data, true);
      }
    }
    // quickly until the first points are in, then at a pace a chart needs
    setTimeout(step, box.classList.contains("has-data") ? POLL_MS * 3 : POLL_MS);
  };
  step();
}

// This month's GPU-hours and cost per tenant against its quota and budget, day by day.
function followMonth(box) {
  const step = async () => {
    let body;
    try {
      body = await getJSON(box.dataset.month);
    } catch (e) {
      setTimeout(step, POLL_MS * 20);
      return;
    }
    const pad = (values) => body.days.map((_, i) => (i < values.length ? values[i] : null));
    const flat = (amount) => body.days.map(() => amount);
    for (const t of body.tenants) {
      const [section, charts] = chartGroup(box, t.tenant, `${t.tenant}, ${body.month}`, [
        ["hours", `${t.tenant}: GPU-hours this month`],
        ["cost", `${t.tenant}: cost this month (USD)`],
      ]);
      section.dataset.tenant = t.tenant;
      section.dataset.days = String(t.gpu_hours.length);
      const hours = [{ label: "GPU-hours", stroke: "#0b5cad" }];
      const hoursData = [body.days, pad(t.gpu_hours)];
      if (t.quota_gpu_hours) { hours.push({ label: "quota allows", stroke: "#57606a", dash: [6, 4] }); hoursData.push(t.quota_gpu_hours); }
      if (t.budgets.gpu_hours !== undefined) { hours.push({ label: "budget", stroke: "#b42318", dash: [2, 3] }); hoursData.push(flat(t.budgets.gpu_hours)); }
      const cost = [{ label: "USD", stroke: "#1a7f37" }];
      const costData = [body.days, pad(t.cost)];
      if (t.budgets.usd !== undefined) { cost.push({ label: "budget", stroke: "#b42318", dash: [2, 3] }); costData.push(flat(t.budgets.usd)); }
      draw(charts.hours, "day of month", hours, hoursData);
      draw(charts.cost, "day of month", cost, costData);
    }
    box.classList.add("has-data");
    setTimeout(step, POLL_MS * 20);
  };
  step();
}

// A deployment's traffic split over time, as steps: from the data the versions page's live
// part carries (data-split), drawn again each time that part is swapped in.
function drawSplit(root) {
  const source = root.querySelector("[data-split]");
  const el = document.getElementById("split-chart");
  if (!source || !el) { return; }
  const split = JSON.parse(source.dataset.split);
  const steps = uPlot.paths.stepped({ align: 1 });
  const series = split.versions.map((v, i) => ({
    label: `version ${v.version} (%)`, stroke: PALETTE[i % PALETTE.length], paths: steps, spanGaps: false,
  }));
  draw(el, "time", series, [split.at, ...split.versions.map((v) => v.percent)], true, [0, 100]);
  el.dataset.versions = split.versions.map((v) => v.version).join(" ");
}

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
  for (const box of root.querySelectorAll("[data-series]#traffic:not([data-started])")) {
    box.dataset.started = "true"; followTraffic(box);
  }
  for (const box of root.querySelectorAll("[data-month]:not([data-started])")) {
    box.dataset.started = "true"; followMonth(box);
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

document.addEventListener("DOMContentLoaded", () => { setUp(document); drawSplit(document); });
document.addEventListener("htmx:afterSettle", (event) => drawSplit(event.target));
