// The daemon's page: one status stream (GET /v1/status/stream) drives every view; the
// playground streams completions with the `token_marks` extension. Streams are read with
// fetch, not EventSource, so the API key goes in a header, never in a URL.
"use strict";

const KEY_STORE = "mtplxd.apiKey";
const WINDOW_S = 300;            // the plots' window, as the daemon keeps it
const RETRY_MS = [500, 1000, 2000, 4000];
const COLORS = ["#2a9d8f", "#457b9d", "#e9a23b", "#c8553d", "#6d597a"];
const CLASSES = ["interactive", "normal", "background"];

const $ = (id) => document.getElementById(id);
const state = { points: [], retries: 0, lastSeen: 0, play: null, chat: [] };

// -- the API key ----------------------------------------------------------------------

function headers(extra) {
  const key = sessionStorage.getItem(KEY_STORE);
  return Object.assign(key ? { Authorization: "Bearer " + key } : {}, extra || {});
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-input").placeholder = message || "API key";
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
  $("key-input").value = "";
  $("key-form").hidden = true;
  state.retries = 0;
  // A daemon with an API key: ask for it before the first call (no refused request first).
if (document.querySelector('meta[name="mtplxd-auth"]').content === "key" && !sessionStorage.getItem(KEY_STORE)) {
  setConn("down", "needs API key");
  askForKey();
} else {
  connect();
}
});

// -- server-sent events over fetch ----------------------------------------------------

// Calls onEvent(name, data) for each event of the response body; resolves at its end.
async function readEvents(response, onEvent, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
      if (signal && signal.aborted) return;
    }
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

// -- the status stream ------------------------------------------------------------------

async function connect() {
  setConn("wait", "connecting");
  try {
    const response = await fetch("/v1/status/stream", { headers: headers(), cache: "no-store" });
    if (response.status === 401) {
      setConn("down", "needs API key");
      askForKey(await errorOf(response));
      return;  // the key form reconnects
    }
    if (!response.ok) throw new Error(await errorOf(response));
    state.retries = 0;
    await readEvents(response, (name, data) => { if (name === "status") show(JSON.parse(data)); });
    throw new Error("the stream ended");
  } catch (err) {
    setConn("down", "down: " + (err.message || err));
    const wait = RETRY_MS[Math.min(state.retries++, RETRY_MS.length - 1)];
    setTimeout(connect, wait);
  }
}

function setConn(kind, text) {
  const badge = $("conn");
  badge.className = "badge " + kind;
  badge.textContent = text;
  badge.dataset.state = kind;
}

function show(doc) {
  setConn(doc.state === "ready" ? "up" : "wait", doc.state === "ready" ? "up" : doc.state);
  if (doc.history) state.points = doc.history;
  if (doc.points) state.points = state.points.concat(doc.points);
  const cut = doc.time - WINDOW_S;
  state.points = state.points.filter((p) => p.t >= cut);
  $("model-name").textContent = doc.model.id || "—";
  $("uptime").textContent = "up " + duration(doc.uptime_s);
  showWarnings(doc.warnings || []);
  showModel(doc.model, doc.memory);
  showQueue(doc.queue, doc.jobs);
  showSessions(doc.sessions);
  drawPlots();
}

// -- the views ----------------------------------------------------------------------------

function showWarnings(warnings) {
  const list = $("warnings");
  list.replaceChildren(...warnings.map((w) => el("li", w)));
}

function showModel(m, memory) {
  const facts = [
    ["name", m.id], ["family", m.family], ["quantization", m.quantization],
    ["MTP heads", m.mtp_heads], ["profile", m.profile],
  ];
  const d = m.decoding || {};
  for (const [key, plan] of Object.entries(d)) {
    if (key.startsWith("t") && plan && plan.mode) {
      facts.push(["depth at " + key.replace("t", "T="), plan.mode === "mtp" ? plan.depth + " (" + plan.source + ")" : "AR (" + plan.source + ")"]);
    }
  }
  if (d.batched_depth) {
    facts.push(["depth by batch rows", Object.entries(d.batched_depth).map(([r, k]) => r + ":" + k).join("  ")]);
  }
  facts.push(["ranks", m.ranks ? m.ranks.size + " (" + m.ranks.sharding + ")" : "1"]);
  if (memory) facts.push(["memory", bytes(memory.active_bytes) + " (peak " + bytes(memory.peak_bytes) + ")"]);
  $("model-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", k), el("dd", v == null ? "—" : String(v))]));
}

function showQueue(queue, jobs) {
  const rows = CLASSES.map((c) => tr([c, queue.queued[c] || 0, secs(queue.longest_wait_s[c] || 0)]));
  rows.push(tr(["running", queue.active, ""]));
  $("queue-classes").tBodies[0].replaceChildren(...rows);
  $("jobs").tBodies[0].replaceChildren(...jobs.map((j) => {
    const row = tr([j.id, j.client, j.priority, j.running ? "running" : "queued", secs(j.wait_s), j.tokens, j.tokens_per_s.toFixed(1)]);
    row.dataset.client = j.client;
    return row;
  }));
}

function showSessions(s) {
  if (!s || !s.enabled) {
    $("bank-summary").textContent = "off";
    $("bank").tBodies[0].replaceChildren();
    return;
  }
  $("bank-summary").textContent = "RAM " + bytes(s.ram_bytes) + " of " + bytes(s.ram_budget) + ", disk " +
    bytes(s.disk_bytes) + " of " + bytes(s.disk_budget) + ", hit rate " + pct(s.hit_rate);
  $("bank").tBodies[0].replaceChildren(...s.workspaces.map((w) =>
    tr([w.workspace, w.ram_entries + " / " + w.disk_entries, bytes(w.ram_bytes), bytes(w.disk_bytes), pct(w.hit_rate)])));
}

// -- the plots: plain canvas ---------------------------------------------------------------

function drawPlots() {
  const p = state.points;
  const t = p.map((x) => x.t);
  plot("plot-tps", t, [{ label: "tok/s", values: p.map((x) => x.tokens_per_s) }]);
  plot("plot-batch", t, [{ label: "rows", values: p.map((x) => x.batch || null) }]);
  const heads = Math.max(0, ...p.map((x) => x.acceptance.length));
  const acc = [];
  for (let k = 0; k < heads; k++) acc.push({ label: "head " + (k + 1), values: p.map((x) => x.acceptance[k] ?? null) });
  plot("plot-accept", t, acc, 1);
  plot("plot-wait", t, CLASSES.map((c) => ({ label: c, values: p.map((x) => x.queue_wait_s[c] ?? null) })));
}

function plot(id, times, series, fixedMax) {
  const canvas = $(id);
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * ratio)) { canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio); }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  const style = getComputedStyle(document.body);
  const muted = style.getPropertyValue("--muted") || "#888", line = style.getPropertyValue("--line") || "#ddd";
  const left = 40, right = 8, top = 8, bottom = 18;
  const all = series.flatMap((s) => s.values).filter((v) => v != null);
  const max = fixedMax || niceMax(Math.max(0, ...all));
  const now = times.length ? times[times.length - 1] : 0;
  const x = (t) => left + (w - left - right) * (1 - (now - t) / WINDOW_S);
  const y = (v) => top + (h - top - bottom) * (1 - v / max);
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = muted; g.strokeStyle = line; g.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const v = (max * i) / 2, yy = y(v);
    g.beginPath(); g.moveTo(left, yy); g.lineTo(w - right, yy); g.stroke();
    g.fillText(short(v), 2, yy + 4);
  }
  g.fillText("-" + WINDOW_S / 60 + " min", left, h - 4);
  g.fillText("now", w - right - 22, h - 4);
  series.forEach((s, i) => {
    g.strokeStyle = COLORS[i % COLORS.length]; g.lineWidth = 1.5;
    g.beginPath();
    let pen = false;
    s.values.forEach((v, j) => {
      if (v == null) { pen = false; return; }
      if (pen) g.lineTo(x(times[j]), y(v)); else g.moveTo(x(times[j]), y(v));
      pen = true;
    });
    g.stroke();
    g.fillStyle = COLORS[i % COLORS.length];
    s.values.forEach((v, j) => {  // a lone point (one busy second) has no line: a dot
      if (v != null && s.values[j - 1] == null && s.values[j + 1] == null) g.fillRect(x(times[j]) - 1.5, y(v) - 1.5, 3, 3);
    });
    if (series.length > 1) { g.fillStyle = COLORS[i % COLORS.length]; g.fillText(s.label, left + 6 + i * 80, top + 10); }
  });
}

function niceMax(v) {
  if (v <= 0) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 5, 10].map((m) => m * step).find((m) => m >= v);
}

// -- the playground ---------------------------------------------------------------------

$("play-form").addEventListener("submit", (e) => { e.preventDefault(); play(); });
$("play-stop").addEventListener("click", () => state.play && state.play.abort());
$("play-clear").addEventListener("click", () => { state.chat = []; $("play-output").replaceChildren(); hideError(); });

function samplerFields() {
  const body = { max_tokens: num("play-max-tokens") || 64 };
  for (const [id, field] of [["play-temperature", "temperature"], ["play-top-p", "top_p"], ["play-top-k", "top_k"], ["play-seed", "seed"]]) {
    const v = num(id);
    if (v != null) body[field] = v;
  }
  return body;
}

async function play() {
  const text = $("play-input").value;
  if (!text.trim() || state.play) return;
  hideError();
  const chat = $("play-mode").value === "chat";
  const body = Object.assign(samplerFields(), { stream: true, token_marks: true, stream_options: { include_usage: true } });
  let turn;
  if (chat) {
    body.messages = state.chat.concat([{ role: "user", content: text }]);
    turn = el("div", ""); turn.className = "turn";
    const user = el("div", "> " + text); user.className = "user";
    $("play-output").append(user, turn);
  } else {
    body.prompt = text;
    turn = el("div", ""); turn.className = "turn";
    $("play-output").replaceChildren(turn);
    turn.append(el("span", text));
  }
  const answer = { text: "", tokens: 0, first: 0, drafts: 0 };
  for (const id of ["play-tps", "play-acceptance", "play-detail"]) $(id).textContent = id === "play-detail" ? "" : "—";
  $("play-tokens").textContent = "0";
  const controller = new AbortController();
  state.play = controller;
  setPlaying(true);
  try {
    const response = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal: controller.signal,
    });
    if (response.status === 401) askForKey("the daemon refused the key");
    if (!response.ok) throw new Error(await errorOf(response));
    await readEvents(response, (_, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk, turn, answer);
    }, controller.signal);
    if (chat) state.chat = body.messages.concat([{ role: "assistant", content: answer.text }]);
  } catch (err) {
    if (err.name !== "AbortError") showError(err.message || String(err));
  } finally {
    state.play = null;
    setPlaying(false);
  }
}

function onChunk(chunk, turn, answer) {
  for (const mark of chunk.token_marks || []) {
    const span = el("span", mark.text);
    span.className = "tok src-" + Math.min(mark.source, 3);
    span.title = mark.source ? "draft of head " + mark.source + ", accepted" : "trunk (verified or bonus)";
    turn.append(span);
    answer.tokens += 1;
    if (mark.source) answer.drafts += 1;
  }
  for (const choice of chunk.choices || []) {
    answer.text += choice.delta ? (choice.delta.content || "") : (choice.text || "");
  }
  if (answer.tokens && !answer.first) answer.first = performance.now();
  const elapsed = (performance.now() - answer.first) / 1000;
  $("play-tokens").textContent = answer.tokens;
  if (answer.tokens > 1 && elapsed > 0) $("play-tps").textContent = ((answer.tokens - 1) / elapsed).toFixed(1);
  $("play-acceptance").textContent = answer.tokens ? pct(answer.drafts / answer.tokens) + " of tokens drafted" : "—";
  if (chunk.mtp) {
    const m = chunk.mtp;
    $("play-acceptance").textContent = m.drafted ? pct(m.accepted / m.drafted) : "no drafts (AR)";
    $("play-detail").textContent = "depth " + m.depth + ", drafted " + m.drafted + ", accepted " + m.accepted +
      (m.acceptance_by_depth.length ? ", by position " + m.acceptance_by_depth.map(pct).join(" ") : "");
  }
  if (chunk.timings && chunk.timings.decode_tokens_per_s) $("play-tps").textContent = chunk.timings.decode_tokens_per_s.toFixed(1);
}

function setPlaying(on) {
  $("play-send").disabled = on;
  $("play-stop").disabled = !on;
}

function showError(message) { $("play-error").textContent = message; $("play-error").hidden = false; }
function hideError() { $("play-error").hidden = true; $("play-error").textContent = ""; }

// -- small helpers ------------------------------------------------------------------------

function el(tag, text) { const e = document.createElement(tag); e.textContent = text; return e; }
function tr(cells) { const row = document.createElement("tr"); row.append(...cells.map((c) => el("td", String(c)))); return row; }
function num(id) { const v = $(id).value; return v === "" ? null : Number(v); }
function pct(v) { return v == null ? "—" : (100 * v).toFixed(0) + "%"; }
function secs(v) { return v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(1) + " s"; }
function short(v) { return v >= 1000 ? (v / 1000).toFixed(1) + "k" : v === 0 ? "0" : Number(v.toPrecision(2)).toString(); }
function duration(s) { s = Math.floor(s || 0); return s >= 3600 ? Math.floor(s / 3600) + "h " + Math.floor(s / 60) % 60 + "m" : Math.floor(s / 60) + "m " + (s % 60) + "s"; }
function bytes(n) {
  if (n == null) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

// A daemon with an API key: ask for it before the first call (no refused request first).
if (document.querySelector('meta[name="mtplxd-auth"]').content === "key" && !sessionStorage.getItem(KEY_STORE)) {
  setConn("down", "needs API key");
  askForKey();
} else {
  connect();
}
