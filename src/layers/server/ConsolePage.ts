/**
 * The console `swactor serve` answers at `GET /`: one self-contained page (its script and style inline, nothing
 * fetched from elsewhere, so it ships inside the package and works with no internet). It reads `/api/events` (the
 * status, domain/consoleStatus.ts, pushed as server-sent events) with fetch, so it can send the API key as a bearer
 * token (an EventSource cannot); shows the nodes, the plan, the live figures and the models; and streams a chat from
 * `/v1/chat/completions`. When the server asks for a key (401), the page asks for it and keeps it in the tab's
 * sessionStorage.
 */

/** The page's headers: no other origin's script, style or connection, and never inside another page's frame. */
export const consolePageHeaders = {
  "content-security-policy":
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; " +
    "img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
  "x-content-type-options": "nosniff",
  "referrer-policy": "no-referrer",
  "cache-control": "no-store"
}

export const consolePage = String.raw`<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swactor console</title>
<style>
  :root { color-scheme: light dark; --line: #8884; --ok: #2a8a3e; --warn: #b7791f; --bad: #c53030; --info: #2b6cb0; }
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; padding: 1rem 1.5rem; max-width: 1100px; }
  h1 { font-size: 1.3rem; margin: 0 0 .2rem; } h2 { font-size: 1rem; margin: 1.2rem 0 .4rem; }
  table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .25rem .5rem; border-bottom: 1px solid var(--line); }
  th { font-weight: 600; } .num { text-align: right; font-variant-numeric: tabular-nums; }
  .state { font-weight: 600; } .ready { color: var(--ok); } .loading { color: var(--info); } .reviving { color: var(--warn); } .lost, .faulted { color: var(--bad); }
  progress { width: 8rem; vertical-align: middle; }
  .figures { display: flex; gap: 1rem; flex-wrap: wrap; } .figure { border: 1px solid var(--line); border-radius: 6px; padding: .4rem .8rem; min-width: 8rem; }
  .figure b { display: block; font-size: 1.2rem; font-variant-numeric: tabular-nums; }
  #chat-output { white-space: pre-wrap; border: 1px solid var(--line); border-radius: 6px; padding: .5rem; min-height: 4rem; }
  #chat-output .user { font-weight: 600; } textarea { width: 100%; box-sizing: border-box; min-height: 3rem; }
  .muted { opacity: .7; } .error { color: var(--bad); } [hidden] { display: none !important; }
</style>
</head>
<body>
<h1>swactor console</h1>
<div id="server-status" class="muted">connecting…</div>
<form id="key-form" hidden>
  <p>This server needs an API key.</p>
  <input id="key-input" type="password" autocomplete="off" placeholder="API key" size="40">
  <button id="key-send" type="submit">Use key</button> <span id="key-error" class="error"></span>
</form>
<main id="console" hidden>
  <h2>Live</h2>
  <div id="live" class="figures"></div>
  <h2>Nodes</h2>
  <table id="nodes"><thead><tr><th>address</th><th>state</th><th class="num">memory used / total</th><th class="num">cores</th><th>backend</th></tr></thead><tbody></tbody></table>
  <h2>Plan</h2>
  <div id="plan-context" class="muted"></div>
  <table id="plan"><thead><tr><th>stage</th><th>blocks</th><th>node</th><th class="num">weights</th><th class="num">KV</th></tr></thead><tbody></tbody></table>
  <h2>Models</h2>
  <ul id="models"></ul>
  <h2>Chat</h2>
  <div id="chat-output"></div>
  <form id="chat-form">
    <textarea id="chat-input" placeholder="Say something"></textarea>
    <button id="chat-send" type="submit">Send</button> <span id="chat-rate" class="muted"></span>
  </form>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let key = sessionStorage.getItem("swactor.apiKey") || "";
let streamAbort = null;
const history = [];
const headers = (extra) => Object.assign({}, extra || {}, key ? { authorization: "Bearer " + key } : {});
const el = (tag, attrs, text) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const bytes = (n) => {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
};
const row = (cells) => {
  const tr = el("tr");
  for (const c of cells) {
    const td = el("td", c.cls ? { class: c.cls } : {});
    if (c.node) td.append(...c.node); else td.textContent = c.text;
    tr.append(td);
  }
  return tr;
};
function askForKey(message) {
  if (streamAbort) streamAbort.abort();
  $("console").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("server-status").textContent = "locked";
}
function render(s) {
  $("console").hidden = false;
  $("key-form").hidden = true;
  const st = $("server-status");
  st.className = "state " + s.status;
  st.textContent = "server " + s.status + (s.detail ? ": " + s.detail : "");
  const nodes = $("nodes").tBodies[0];
  nodes.replaceChildren(...s.nodes.map((n) => {
    const state = [el("span", { class: "state " + n.state }, n.state)];
    if (n.state === "loading") {
      const p = el("progress", { max: "1" });
      if (n.progress !== null) p.value = n.progress;
      state.push(document.createTextNode(" "), p);
    }
    if (n.detail) state.push(el("div", { class: "muted" }, n.detail));
    const tr = row([{ text: n.address }, { node: state }, { cls: "num", text: bytes(n.memoryUsedBytes) + " / " + bytes(n.memoryTotalBytes) }, { cls: "num", text: n.cores === null ? "?" : String(n.cores) }, { text: n.backend === null ? "?" : n.backend }]);
    tr.dataset.address = n.address; tr.dataset.state = n.state;
    return tr;
  }));
  $("plan-context").textContent = s.plan.stages.length === 0 ? "not planned yet" : "KV per sequence of " + s.plan.contextTokens + " tokens";
  $("plan").tBodies[0].replaceChildren(...s.plan.stages.map((p) =>
    row([{ text: String(p.stageIndex) }, { text: p.layers[0] + "–" + (p.layers[1] - 1) }, { text: p.address }, { cls: "num", text: bytes(p.weightBytes) }, { cls: "num", text: bytes(p.kvBytes) }])));
  const l = s.live;
  const fig = (label, value, id) => { const d = el("div", { class: "figure", id: id }); d.append(el("b", {}, value), el("span", { class: "muted" }, label)); return d; };
  $("live").replaceChildren(
    fig("tokens/s", l.tokensPerSecond.toFixed(1), "live-tps"),
    fig("time to first token", l.timeToFirstTokenSeconds === null ? "–" : (l.timeToFirstTokenSeconds * 1000).toFixed(0) + " ms", "live-ttft"),
    fig("in flight", String(l.inFlight), "live-inflight"),
    fig("queued", String(l.queued), "live-queued"),
    fig("recoveries", String(l.recoveries), "live-recoveries"),
    fig("completed", String(l.completed), "live-completed"));
  $("models").replaceChildren(...s.models.map((m) => el("li", {}, m.id + (m.layers === null ? "" : " — " + m.layers + " blocks, context " + m.contextLength))));
}
async function follow() {
  const abort = new AbortController();
  streamAbort = abort;
  let response;
  try {
    response = await fetch("api/events", { headers: headers(), signal: abort.signal });
  } catch (e) {
    if (!abort.signal.aborted) setTimeout(follow, 2000);
    return;
  }
  if (response.status === 401) { askForKey(key ? "that key was refused" : ""); return; }
  if (!response.ok || !response.body) { $("server-status").textContent = "status " + response.status; setTimeout(follow, 2000); return; }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("\n");
        if (data) render(JSON.parse(data));
      }
    }
  } catch (e) { /* the connection broke: follow again */ }
  if (!abort.signal.aborted) { $("server-status").textContent = "reconnecting…"; setTimeout(follow, 1000); }
}
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  key = $("key-input").value.trim();
  sessionStorage.setItem("swactor.apiKey", key);
  follow();
});
$("chat-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  $("chat-send").disabled = true;
  history.push({ role: "user", content: text });
  const out = $("chat-output");
  out.append(el("div", { class: "user" }, text));
  const answer = el("div", { class: "assistant" });
  out.append(answer);
  const started = performance.now();
  let tokens = 0;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers({ "content-type": "application/json" }),
      body: JSON.stringify({ messages: history, stream: true, max_tokens: 128 })
    });
    if (response.status === 401) { askForKey("that key was refused"); return; }
    if (!response.ok || !response.body) { answer.className = "error"; answer.textContent = "error " + response.status + ": " + (await response.text()); return; }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, end).split("\n").find((l) => l.startsWith("data: "));
        buffer = buffer.slice(end + 2);
        if (!line || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) { answer.className = "error"; answer.textContent += " " + chunk.error.message; continue; }
        const piece = chunk.choices && chunk.choices[0] && chunk.choices[0].delta && chunk.choices[0].delta.content;
        if (piece) {
          tokens++;
          answer.textContent += piece;
          answer.dataset.pieces = String(tokens);
          $("chat-rate").textContent = (tokens / ((performance.now() - started) / 1000)).toFixed(1) + " tokens/s";
        }
      }
    }
    history.push({ role: "assistant", content: answer.textContent });
    answer.dataset.done = "true";
  } catch (err) {
    answer.className = "error";
    answer.textContent += " (" + err + ")";
  } finally {
    $("chat-send").disabled = false;
  }
});
follow();
</script>
</body>
</html>
`
