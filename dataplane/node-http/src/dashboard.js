"use strict";
// The operator dashboard (served as /dashboard.js). It reads the node's own /metrics and —
// signed in with a viewer token, which the node keeps in an HttpOnly cookie this script never
// sees — the admin audit log, and redraws every second. Read-only: it never calls a mutating
// endpoint. Everything shown is put in as text (textContent), never as HTML: audit keys and
// reasons, tenant and account names can come from clients.

function parse(text) {
  const rows = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-z_]+)(\{(.*)\})? (\S+)$/);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const kv of m[3].matchAll(/([a-z_]+)="((?:[^"\\]|\\.)*)"/g)) labels[kv[1]] = kv[2];
    rows.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return rows;
}
const sel = (rows, name, pred = () => true) => rows.filter(r => r.name === name && pred(r.labels));
const sum = (rs) => rs.reduce((a, r) => a + r.value, 0);
// A cell: a string or number, or { text, bad } for one shown as a warning.
function cell(tag, c) {
  const el = document.createElement(tag);
  if (c !== null && typeof c === "object") {
    el.textContent = String(c.text);
    if (c.bad) el.className = "bad";
  } else {
    el.textContent = String(c);
  }
  return el;
}
function table(id, head, body) {
  const el = document.getElementById(id);
  const rows = [head.map(h => cell("th", h)), ...body.map(r => r.map(c => cell("td", c)))];
  el.replaceChildren(...rows.map(cells => {
    const tr = document.createElement("tr");
    tr.append(...cells);
    return tr;
  }));
}
// A line of parts, each a string or { text, bad }.
function line(id, parts) {
  const el = document.getElementById(id);
  el.replaceChildren(...parts.map(p => {
    if (p !== null && typeof p === "object") {
      const span = document.createElement("span");
      span.textContent = p.text;
      if (p.bad) span.className = "bad";
      return span;
    }
    return document.createTextNode(p);
  }));
}
// A percentile from a cumulative histogram (bucket upper bounds in seconds).
function percentile(buckets, q) {
  const total = buckets.length ? buckets[buckets.length - 1].value : 0;
  if (!total) return "–";
  for (const b of buckets) if (b.value >= q * total) return b.labels.le === "+Inf" ? "> max" : (Number(b.labels.le) * 1000).toFixed(0) + " ms";
  return "–";
}

async function draw() {
  const metrics = parse(await (await fetch("/metrics")).text());
  const lanes = [...new Set(sel(metrics, "spindle_queued_tasks").map(r => r.labels.lane))];
  table("lanes", ["lane", "admits", "weight", "queued tasks", "queued units", "running units", "capacity units"],
    lanes.map(l => {
      const limit = `lane:${l}:running_units`;
      return [l,
        sum(sel(metrics, "spindle_lane_open", x => x.lane === l)) ? "open" : { text: "CLOSED", bad: true },
        sum(sel(metrics, "spindle_lane_weight", x => x.lane === l)),
        sum(sel(metrics, "spindle_queued_tasks", x => x.lane === l)),
        sum(sel(metrics, "spindle_queued_units", x => x.lane === l)).toFixed(1),
        (sum(sel(metrics, "spindle_node_limit_used", x => x.limit === limit)) / 1000).toFixed(1),
        (sum(sel(metrics, "spindle_node_limit_capacity", x => x.limit === limit)) / 1000).toFixed(1)];
    }));
  const running = sel(metrics, "spindle_tenant_running_units");
  const totalRunning = sum(running) || 1;
  // Entitlement: the tenant's weight against the weights of everyone running now.
  const weightOf = t => sum(sel(metrics, "spindle_tenant_weight", x => x.tenant === t));
  const totalWeight = running.reduce((a, r) => a + weightOf(r.labels.tenant), 0) || 1;
  table("tenants", ["tenant", "running tasks", "running units", "served share", "entitlement"],
    running.map(r => [r.labels.tenant,
      sum(sel(metrics, "spindle_tenant_running_tasks", x => x.tenant === r.labels.tenant)),
      r.value.toFixed(1), (100 * r.value / totalRunning).toFixed(1) + " %",
      (100 * weightOf(r.labels.tenant) / totalWeight).toFixed(1) + " %"]));
  const bands = [...new Set(sel(metrics, "spindle_dispatch_wait_seconds_count").map(r => r.labels.band))];
  table("waits", ["band", "dispatched", "p50", "p99"], bands.map(b => {
    const lanesOf = sel(metrics, "spindle_dispatch_wait_seconds_bucket", x => x.band === b);
    const byLe = {};
    for (const r of lanesOf) byLe[r.labels.le] = (byLe[r.labels.le] || 0) + r.value;
    const buckets = Object.entries(byLe).map(([le, value]) => ({ labels: { le }, value }))
      .sort((a, c) => (a.labels.le === "+Inf") - (c.labels.le === "+Inf") || Number(a.labels.le) - Number(c.labels.le));
    return [b, sum(sel(metrics, "spindle_dispatch_wait_seconds_count", x => x.band === b)),
      percentile(buckets, 0.5), percentile(buckets, 0.99)];
  }));
  table("admissions", ["decision", "count"],
    sel(metrics, "spindle_admissions_total").filter(r => r.value > 0)
      .map(r => [r.labels.decision, r.value]));
  const providers = [...new Set(sel(metrics, "spindle_node_limit_capacity", x => /^provider:\d+:concurrency$/.test(x.limit)).map(r => r.labels.limit))];
  const circuits = sel(metrics, "spindle_provider_circuit_open");
  const penalized = sel(metrics, "spindle_provider_penalized");
  table("providers", ["account", "in flight", "limit", "rpm share", "penalized", "circuit"], providers.map((limit, i) => {
    const rpm = limit.replace("concurrency", "rpm");
    const c = circuits[i];
    const p = penalized[i];
    return [c ? c.labels.provider : limit,
      sum(sel(metrics, "spindle_node_limit_used", x => x.limit === limit)),
      sum(sel(metrics, "spindle_node_limit_capacity", x => x.limit === limit)),
      sum(sel(metrics, "spindle_node_limit_capacity", x => x.limit === rpm)) + "/min",
      p && p.value ? { text: "halved", bad: true } : "no",
      c && c.value ? { text: "open", bad: true } : "closed"];
  }));
  const engines = [...new Set(sel(metrics, "spindle_media_engine_units").map(r => r.labels.engine))];
  table("media", ["engine", "used", "capacity"], engines.map(e => [e,
    sum(sel(metrics, "spindle_media_engine_units", x => x.engine === e && x.kind === "used")),
    sum(sel(metrics, "spindle_media_engine_units", x => x.engine === e && x.kind === "capacity"))]));
  const jobs = state => sum(sel(metrics, "spindle_media_jobs", x => x.state === state));
  const media = sel(metrics, "spindle_media_jobs").length
    ? `media jobs ${jobs("queued")} queued, ${jobs("running")} running · ` : "";
  // The audit list, with the session's cookie (same origin only): 401 until signed in.
  const res = await fetch("/admin/v1/audit?limit=10", { credentials: "same-origin" });
  const signedIn = res.ok;
  document.getElementById("signin").hidden = signedIn;
  document.getElementById("signout").hidden = !signedIn;
  if (signedIn) {
    const entries = await res.json();
    table("audit", ["version", "actor", "object", "key", "reason"],
      entries.map(e => [e.version, e.actor, e.object, e.key, e.reason]));
  } else {
    table("audit", ["audit"], [["sign in with a viewer token"]]);
  }
  const refused = sum(sel(metrics, "spindle_connections_refused_total"));
  const suspended = sum(sel(metrics, "spindle_tenants_suspended"));
  const ready = sum(sel(metrics, "spindle_ready"));
  line("status", [
    `policy v${sum(sel(metrics, "spindle_policy_version"))} · completed ${sum(sel(metrics, "spindle_tasks_completed_total"))} · `,
    media + `connections ${sum(sel(metrics, "spindle_connections_open"))}`,
    refused ? { text: ` (${refused} refused at the bound)`, bad: true } : "",
    " · ",
    suspended ? { text: `${suspended} tenant(s) suspended by the breaker`, bad: true } : "",
    suspended ? " · " : "",
    ready ? "ready" : { text: "not ready", bad: true },
    " · " + new Date().toISOString(),
  ]);
}
async function loop() {
  try { await draw(); } catch (e) { document.getElementById("status").textContent = "error: " + e; }
  setTimeout(loop, 1000);
}
loop();
