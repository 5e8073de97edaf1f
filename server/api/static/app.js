// The playground: plain JavaScript (ES modules), no framework, no build step. It speaks only the
// HTTP API that every client uses (README, "HTTP API"); the page itself holds no data.
import {api, apiError, auth, headers, sseFrames} from "./api.js";
import {fmtBytes, plot} from "./chart.js";

const ui = {
  models: new Map(),     // name -> /v1/models entry (with its byte figures)
  sessions: new Map(),   // id -> {id, model, parent, via, segments, position, stateBytes, samples}
  current: null,         // id of the session shown
  snapshots: [],         // {id, position, session}
  stream: null,          // {ctrl, sid} while a generation streams
  polling: false,
};

const $ = (id) => document.getElementById(id);
const DRAW_MS = 100;  // the stream's figures and chart are redrawn this often at most

// ---- actions --------------------------------------------------------------------------------

let running = 0;

async function act(fn) {
  $("error").hidden = true;
  running += 1;
  document.body.dataset.busy = "true";
  try {
    await fn();
  } catch (e) {
    showError(e);
  } finally {
    running -= 1;
    if (!running) document.body.dataset.busy = "false";
    renderControls();
  }
}

function showError(e) {
  const box = $("error");
  box.textContent = (e.type ? e.type + ": " : "") + e.message;
  box.hidden = false;
}

async function loadModels() {
  const body = await api("GET", "/v1/models");
  ui.models = new Map(body.data.map((m) => [m.id, m]));
  const sel = $("model");
  sel.replaceChildren(...body.data.map((m) => new Option(`${m.id} (${[...new Set(m.mixers)].join("+")})`, m.id)));
}

// `samples` are the (position, state bytes) pairs read from the server; a branch starts with its
// parent's up to where it branched off, since it holds that same history.
function addSession(desc, parent, via, segments) {
  const inherited = parent ? ui.sessions.get(parent).samples.filter(([x]) => x <= desc.position) : [];
  const s = {id: desc.id, model: desc.model, parent, via, segments, position: desc.position,
             stateBytes: desc.state_bytes, samples: [...inherited, [desc.position, desc.state_bytes]]};
  ui.sessions.set(s.id, s);
  ui.current = s.id;
  render();
  return s;
}

async function startSession() {
  const prompt = $("prompt").value;
  const desc = await api("POST", "/v1/sessions", {model: $("model").value || undefined, prompt});
  addSession(desc, null, null, prompt ? [{kind: "prompt", text: prompt}] : []);
}

async function pushText() {
  const s = current(), text = $("push-text").value;
  const r = await api("POST", `/v1/sessions/${s.id}/push`, {text});
  s.segments.push({kind: "push", text});
  s.position = r.position;
  $("push-text").value = "";
  $("last").textContent = `pushed ${r.tokens} tokens in ${r.prefill_ms} ms`;
  await refresh(s);
}

async function snapshot() {
  const s = current();
  const r = await api("POST", `/v1/sessions/${s.id}/snapshot`);
  ui.snapshots.push({id: r.snapshot_id, position: r.position, session: s.id, bytes: r.bytes});
  $("last").textContent = `snapshot ${short(r.snapshot_id)}: ${fmtBytes(r.bytes)} at position ${r.position}`;
  render();
}

// "at position": a fork there, or the position a rewind goes back to (docs/api.md, Rewind)
const atPosition = () => ($("position").value === "" ? null : Number($("position").value));

async function fork() {
  const s = current(), p = atPosition();
  const desc = await api("POST", `/v1/sessions/${s.id}/fork`, p === null ? undefined : {position: p});
  const child = addSession(desc, s.id, p === null ? "fork" : `fork @${p}`, s.segments.map((g) => ({...g, inherited: true})));
  if (p !== null) cutTo(child, (await api("GET", `/v1/sessions/${child.id}/history`)).text);
  render();
}

async function rewind() {
  const s = current(), p = atPosition();
  if (p === null) throw Object.assign(new Error("give the position to go back to"), {type: "position"});
  const r = await api("POST", `/v1/sessions/${s.id}/rewind`, {position: p});
  cutTo(s, (await api("GET", `/v1/sessions/${s.id}/history`)).text);
  s.samples = s.samples.filter(([x]) => x <= p);
  $("last").textContent = `back at position ${r.position}: from the state kept at ${r.from_position}, `
    + `${r.prefilled} tokens prefilled in ${r.prefill_ms} ms`;
  await refresh(s);
}

// The session's text cut back to what its history holds (after a rewind, or a fork part way):
// its segments kept as far as they reach, else the history as one.
function cutTo(s, text) {
  if (!textOf(s).startsWith(text)) {
    s.segments = [{kind: "prompt", text}];
    return;
  }
  let left = text.length;
  s.segments = s.segments.map((g) => {
    const t = g.text.slice(0, Math.max(0, left));
    left -= t.length;
    return {...g, text: t};
  }).filter((g) => g.text);
}

async function restore(snap) {
  const desc = await api("POST", "/v1/sessions/restore", {snapshot_id: snap.id});
  const h = await api("GET", `/v1/sessions/${desc.id}/history`);
  addSession(desc, snap.session, "restore " + short(snap.id), [{kind: "prompt", text: h.text}]);
}

async function generate() {
  const s = current();
  const body = {max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value), stream: true};
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const ctrl = new AbortController();
  ui.stream = {ctrl, sid: s.id};
  renderControls();
  const seg = {kind: "gen", text: ""}, before = textOf(s);
  const gaps = [];
  let last = performance.now(), stopped = false, ttft = null, drawTimer = null;
  try {
    const r = await fetch(`/v1/sessions/${s.id}/generate`, {method: "POST", headers: headers(true),
                                                             body: JSON.stringify(body), signal: ctrl.signal});
    if (!r.ok) throw await apiError(r);
    s.segments.push(seg);
    for await (const f of sseFrames(r.body)) {
      if (f.data === "[DONE]") break;
      const ev = JSON.parse(f.data);
      const now = performance.now();
      if (f.event === "token") {
        if (ttft === null) ttft = now - last; else gaps.push(now - last);
        last = now;
        seg.text += ev.text;
        s.position = ev.position;
        if (ui.current === s.id) appendText(ev.text, "gen");
        // redrawn at most every DRAW_MS, not per token: a long stream's gaps are many
        if (!drawTimer) drawTimer = setTimeout(() => { drawTimer = null; drawStream(gaps.length + 1, ttft, gaps); }, DRAW_MS);
        poll(s);
      } else if (f.event === "done") {
        $("last").textContent = `finish: ${ev.finish_reason}; server: first token ${ev.timings.ttft_ms} ms, `
          + `${ev.timings.per_token_ms} ms per token` + (ev.persisted ? "" : " (not yet persisted)");
        if (ev.error) showError(ev.error);
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") throw e;
    stopped = true;
  } finally {
    ui.stream = null;
    clearTimeout(drawTimer);
    if (ttft !== null) drawStream(gaps.length + 1, ttft, gaps);
  }
  if (stopped) await settle(s, before, seg);
  await refresh(s);
}

// A stopped stream: the server keeps exactly the tokens it handed to the connection, which may be
// a few more than the page had read when it hung up. Its history says which; show that.
async function settle(s, before, seg) {
  for (let i = 0; i < 100; i++) {
    const d = await api("GET", `/v1/sessions/${s.id}`);
    if (!d.busy) break;
    await new Promise((ok) => setTimeout(ok, 50));
  }
  const h = await api("GET", `/v1/sessions/${s.id}/history`);
  const shown = seg.text.length;
  if (h.text.startsWith(before)) {
    seg.text = h.text.slice(before.length);
  } else {  // cannot tell the parts apart: show the whole history as one
    s.segments = [{kind: "prompt", text: h.text}];
  }
  s.position = h.position;
  $("last").textContent = `stopped: the server kept ${seg.text.length} characters of this stream `
    + `(the page had shown ${shown})`;
  render();
}

// ---- figures --------------------------------------------------------------------------------

async function refresh(s) {
  const d = await api("GET", `/v1/sessions/${s.id}`);
  s.position = d.position;
  s.stateBytes = d.state_bytes;
  s.samples.push([d.position, d.state_bytes]);
  render();
}

// While a stream runs, the session's bytes are read now and then (one request at a time).
function poll(s) {
  if (ui.polling) return;
  ui.polling = true;
  api("GET", `/v1/sessions/${s.id}`).then((d) => {
    s.stateBytes = d.state_bytes;
    s.samples.push([d.position, d.state_bytes]);
    if (ui.current === s.id) drawFigures(s);
  }).catch(() => { /* the stream's own errors are what the user needs to see */ })
    .finally(() => setTimeout(() => { ui.polling = false; }, 200));
}

// The KV cache a softmax model would hold: the served softmax model's own figure if there is
// one, else what the softmax mixer allocates per token for this model's shape (server-computed).
function kvPerToken(model) {
  for (const m of ui.models.values()) {
    if (m.mixers.every((x) => x === "softmax")) return [m.kv_bytes_per_token, `${m.id} KV cache`];
  }
  const m = ui.models.get(model);
  return m ? [m.softmax_kv_bytes_per_token, "softmax KV cache, same shape"] : [0, "softmax KV cache"];
}

function drawStream(n, ttft, gaps) {
  $("fig-tokens").textContent = String(n);
  $("fig-ttft").textContent = ttft === null ? "–" : `${ttft.toFixed(1)} ms`;
  const sorted = [...gaps].sort((a, b) => a - b);
  $("fig-gap").textContent = sorted.length ? `${sorted[sorted.length >> 1].toFixed(2)} ms` : "–";
  // a rare stall (another process, a GC) would flatten the rest: the scale stops at twice the
  // 95th percentile, and what goes past it is drawn at the top and counted
  const yMax = Math.max(1, Math.min(sorted[sorted.length - 1] || 0, 2 * (sorted[Math.floor(sorted.length * 0.95)] || 0)));
  const over = gaps.filter((g) => g > yMax).length;
  plot($("latency"), [{points: gaps.map((g, i) => [i + 2, Math.min(g, yMax)]), cls: "lat"}], n, yMax,
       `${yMax.toFixed(1)} ms` + (over ? ` (${over} above)` : ""));
}

function drawFigures(s) {
  const [perTok, label] = kvPerToken(s.model);
  $("fig-position").textContent = String(s.position);
  $("fig-state").textContent = fmtBytes(s.stateBytes);
  $("fig-kv-label").textContent = `${label} here`;
  $("fig-kv").textContent = fmtBytes(perTok * s.position);
  $("kv-legend").textContent = label;
  const m = ui.models.get(s.model);
  $("model-figures").textContent = m ? `${m.id}: ${fmtBytes(m.state_bytes_per_session)} per session`
    + (m.kv_bytes_per_token ? ` + ${fmtBytes(m.kv_bytes_per_token)} per token` : ", whatever the position")
    + `; a softmax KV cache adds ${fmtBytes(perTok)} per token` : "";
  const xMax = Math.max(1, s.position);
  const samples = s.samples.filter(([x]) => x <= xMax).sort((a, b) => a[0] - b[0]);
  const yMax = Math.max(perTok * xMax, ...samples.map(([, y]) => y), 1);
  plot($("bytes"), [{points: samples, cls: "state"}, {points: [[0, 0], [xMax, perTok * xMax]], cls: "kv"}],
       xMax, yMax, fmtBytes(yMax));
}

// ---- rendering ------------------------------------------------------------------------------

const current = () => ui.sessions.get(ui.current);
const short = (id) => id.replace(/^[a-z]+_/, "").slice(0, 8);  // ids are "sess_..." and "snap_..."
const textOf = (s) => s.segments.map((g) => g.text).join("");

function appendText(text, kind) {
  const pre = $("text");
  const lastEl = pre.lastElementChild;
  if (lastEl && lastEl.dataset.live === "1") lastEl.append(text);
  else pre.append(Object.assign(document.createElement("span"), {className: kind, textContent: text}));
  pre.lastElementChild.dataset.live = "1";
  pre.scrollTop = pre.scrollHeight;
}

function renderTree() {
  const item = (s) => {
    const li = document.createElement("li");
    const b = Object.assign(document.createElement("button"), {type: "button", className: "node"});
    b.dataset.sid = s.id;
    b.textContent = `${short(s.id)} · ${s.position}` + (s.via ? ` · ${s.via}` : "");
    if (s.id === ui.current) b.classList.add("current");
    b.onclick = () => { if (!ui.stream) { ui.current = s.id; render(); } };
    li.append(b);
    const kids = [...ui.sessions.values()].filter((c) => c.parent === s.id);
    if (kids.length) {
      const ul = document.createElement("ul");
      ul.append(...kids.map(item));
      li.append(ul);
    }
    return li;
  };
  $("tree").replaceChildren(...[...ui.sessions.values()].filter((s) => !s.parent).map(item));
  $("snapshots").replaceChildren(...ui.snapshots.map((snap) => {
    const li = document.createElement("li");
    const b = Object.assign(document.createElement("button"), {type: "button", className: "restore"});
    b.dataset.snapshot = snap.id;
    b.textContent = "Restore";
    b.onclick = () => act(() => restore(snap));
    li.append(b, ` ${short(snap.id)} · ${snap.position} of ${short(snap.session)}`);
    return li;
  }));
}

function renderControls() {
  const s = current(), streaming = !!ui.stream;
  for (const id of ["generate", "push", "snapshot", "fork", "rewind", "start"]) $(id).disabled = streaming || (id !== "start" && !s);
  for (const b of document.querySelectorAll("button.restore")) b.disabled = streaming;
  $("stop").disabled = !streaming;
}

function render() {
  const s = current();
  renderTree();
  renderControls();
  if (!s) return;
  $("session-line").textContent = `session ${s.id} · ${s.model}` + (s.via ? ` · ${s.via} of ${short(s.parent)}` : "");
  $("session-line").dataset.sid = s.id;
  if (!ui.stream || ui.stream.sid !== s.id) {
    $("text").replaceChildren(...s.segments.map((g) =>
      Object.assign(document.createElement("span"), {className: g.kind + (g.inherited ? " inherited" : ""),
                                                     textContent: g.text})));
  }
  drawFigures(s);
}

// ---- wiring ---------------------------------------------------------------------------------

function on(id, fn) {
  $(id).addEventListener("submit", (e) => { e.preventDefault(); act(fn); });
}

// The key box is no form (nothing for a browser to offer to save): the button or Enter uses the key.
async function useKey() {
  auth.key = $("key").value.trim();
  $("key-state").textContent = auth.key ? "key set (kept in this page only)" : "no key";
  await loadModels();
}
$("use-key").addEventListener("click", () => act(useKey));
$("key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); act(useKey); } });
on("start-form", startSession);
on("gen-form", generate);
on("push-form", pushText);
$("snapshot").onclick = () => act(snapshot);
$("fork").onclick = () => act(fork);
$("rewind").onclick = () => act(rewind);
$("stop").onclick = () => { if (ui.stream) ui.stream.ctrl.abort(); };
render();
act(loadModels);
