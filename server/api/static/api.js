// The HTTP API as the page uses it: JSON calls, errors as {message, type, param, code}, and SSE over a POST.

export const auth = {key: ""};  // the API key: page memory only, never written to storage

export function headers(json) {
  const h = {};
  if (auth.key) h.Authorization = "Bearer " + auth.key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

export async function apiError(r) {
  // every error the server sends is {"error": {"message", "type", "param", "code"}}; anything else says its status
  let type = "http_" + r.status, message = r.statusText || "request failed";
  try {
    const e = (await r.json()).error;
    if (e && e.message) ({type, message} = e);
  } catch (_) { /* not JSON: keep the status */ }
  const err = new Error(message);
  err.type = type;
  return err;
}

export async function api(method, path, body) {
  const r = await fetch(path, {method, headers: headers(body !== undefined),
                               body: body === undefined ? undefined : JSON.stringify(body)});
  if (!r.ok) throw await apiError(r);
  return r.status === 204 ? null : r.json();
}

// Server-sent events over a POST: EventSource only GETs, so the frames are parsed here
// (fields per the SSE spec; sse-starlette ends lines with \r\n and sends ": ping" comments).
export async function* sseFrames(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "", carry = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    let chunk = carry + value;
    carry = chunk.endsWith("\r") ? "\r" : "";  // a \r\n may be split between two chunks
    if (carry) chunk = chunk.slice(0, -1);
    buf += chunk.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let v = colon < 0 ? "" : line.slice(colon + 1);
        if (v.startsWith(" ")) v = v.slice(1);
        if (field === "event") event = v;
        else if (field === "data") data.push(v);
      }
      if (data.length) yield {event, data: data.join("\n")};
    }
  }
}
