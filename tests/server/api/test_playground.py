"""The playground page (`/`, server/api/static/), driven in headless Chromium against a real
`linstream serve`: whatever the page shows of a session must be what the API says it holds.

Uses the system browser and driver (Debian's `chromium`, `chromium-driver`; .ci/run installs
them); nothing here downloads one. Without them the browser test is skipped, except under CI.
"""
from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tests.helpers import ServerProcess, make_checkpoint

KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")

pytestmark = pytest.mark.slow


LONG = 100_000  # tokens of the stream that is stopped part-way


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    srv = ServerProcess([str(make_checkpoint(d, "tiny-linear")), str(make_checkpoint(d, "tiny-softmax"))],
                        {"LINSTREAM_MAX_NEW_TOKENS": str(LONG)}, "--api-key", KEY)
    yield srv
    srv.stop()


def api(server, method, path, **kw):
    r = httpx.request(method, server.url + path, headers=AUTH, timeout=10, **kw)
    r.raise_for_status()
    return r.json()


def test_page_is_public_and_models_report_state_bytes(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/app.js">' in page.text
    for f in ("app.js", "api.js", "chart.js", "style.css"):
        assert httpx.get(f"{server.url}/static/{f}").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the page is public, the API is not
    models = {m["id"]: m for m in api(server, "GET", "/v1/models")["data"]}
    lin, soft = models["linear"], models["softmax"]
    assert lin["kv_bytes_per_token"] == 0 and soft["kv_bytes_per_token"] > 0
    # same shape, so the linear model's softmax baseline is the served softmax model's own cache
    assert lin["softmax_kv_bytes_per_token"] == soft["kv_bytes_per_token"]
    for m in (lin, soft):  # the figures predict what a real session holds at its position
        s = api(server, "POST", "/v1/sessions", json={"model": m["id"], "prompt": "ROMEO:\nBut soft"})
        api(server, "POST", f"/v1/sessions/{s['id']}/generate", json={"max_tokens": 9, "stream": False})
        s = api(server, "GET", f"/v1/sessions/{s['id']}")
        assert s["state_bytes"] == m["state_bytes_per_session"] + m["kv_bytes_per_token"] * s["position"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and DRIVER):
        why = "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
              "--window-size=1400,900", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(a)
    # the driver's path given, Selenium Manager is not run; offline, it could not fetch anything anyway
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")
        driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
        yield driver
        driver.quit()


class Page:
    """The playground as the tests use it: by the ids in index.html."""

    def __init__(self, driver, server):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select, WebDriverWait
        self.d, self.server, self.By, self.Select = driver, server, By, Select
        self.wait = WebDriverWait(driver, 20)

    def el(self, id_):
        return self.d.find_element(self.By.ID, id_)

    def idle(self):
        self.wait.until(lambda d: d.find_element(self.By.TAG_NAME, "body").get_attribute("data-busy") == "false")

    def click(self, id_):
        self.el(id_).click()
        self.idle()

    def fill(self, id_, value):
        e = self.el(id_)
        e.clear()
        e.send_keys(str(value))

    def error(self) -> str:
        e = self.el("error")
        return e.text if e.is_displayed() else ""

    def sid(self) -> str:
        return self.el("session-line").get_attribute("data-sid")

    def text(self) -> str:
        return self.d.execute_script("return document.getElementById('text').textContent")

    def history(self, sid: str) -> dict:
        return api(self.server, "GET", f"/v1/sessions/{sid}/history")

    def generate(self, n: int, temperature: float = 0.0, seed: int | None = None):
        self.fill("max-tokens", n)
        self.fill("temperature", temperature)
        self.el("seed").clear()
        if seed is not None:
            self.fill("seed", seed)
        self.click("generate")

    def node(self, sid: str):
        return self.d.find_element(self.By.CSS_SELECTOR, f'#tree button[data-sid="{sid}"]')

    def shows(self, sid: str) -> dict:
        """The page shows session `sid`, its text exactly the session's history; returns it."""
        assert self.error() == ""
        assert self.sid() == sid
        h = self.history(sid)
        assert self.text() == h["text"]
        assert self.el("fig-position").text == str(h["position"])
        return h


def test_playground_in_chromium(browser, server):
    p = Page(browser, server)
    browser.get(server.url + "/")
    p.idle()
    # no key yet: the models call is refused, and the page says the API's own message
    assert p.error().startswith("unauthorized: a valid API key is required")
    p.fill("key", KEY)
    p.d.find_element(p.By.CSS_SELECTOR, "#key-form button").click()
    p.idle()
    assert p.error() == ""
    p.Select(p.el("model")).select_by_value("linear")
    p.fill("prompt", "ROMEO:\nBut soft")
    p.click("start")
    root = p.sid()
    h0 = p.shows(root)

    # 32 tokens streamed onto the page, one latency point between each two
    p.generate(32)
    h1 = p.shows(root)
    assert h1["position"] == h0["position"] + 32 and h1["text"] != h0["text"]
    assert p.el("fig-tokens").text == "32"
    assert p.el("latency").get_attribute("data-points") == "31"
    assert p.el("fig-kv").text != "0 B"  # the softmax baseline, from the served softmax model

    p.click("snapshot")
    snap = p.d.find_element(p.By.CSS_SELECTOR, "#snapshots button.restore").get_attribute("data-snapshot")

    # a fork, continued on its own, shown as a branch of the session
    p.click("fork")
    child = p.sid()
    assert child != root
    p.d.find_element(p.By.CSS_SELECTOR, f'#tree button[data-sid="{root}"] + ul button[data-sid="{child}"]')
    assert p.shows(child)["text"] == h1["text"]
    p.generate(16, temperature=1.0, seed=7)
    p.fill("push-text", "\nJULIET:\n")
    p.click("push")
    hc = p.shows(child)
    assert hc["text"].startswith(h1["text"]) and hc["text"].endswith("\nJULIET:\n")

    # the parent is untouched by its fork, and goes on by itself
    p.node(root).click()
    assert p.shows(root) == h1
    p.generate(8)
    h2 = p.shows(root)
    assert h2["position"] == h1["position"] + 8

    # the snapshot restores the parent as it was when taken, as a new branch
    p.d.find_element(p.By.CSS_SELECTOR, f'#snapshots button[data-snapshot="{snap}"]').click()
    p.idle()
    restored = p.sid()
    assert restored not in (root, child)
    hr = p.shows(restored)
    assert hr["text"] == h1["text"] and hr["position"] == h1["position"]
    p.d.find_element(p.By.CSS_SELECTOR, f'#tree button[data-sid="{root}"] + ul button[data-sid="{restored}"]')

    # a long stream stopped part-way: the page ends up showing exactly what the session kept
    p.fill("max-tokens", LONG)  # far longer than the test takes to stop it, on a loaded machine too
    p.el("generate").click()
    # tokens appear while the stream runs (a token may carry no text yet: part of a UTF-8 character)
    p.wait.until(lambda d: p.el("fig-tokens").text.isdigit() and int(p.el("fig-tokens").text) >= 5
                 and len(p.text()) > len(hr["text"]))
    shown = p.text()
    assert shown.startswith(hr["text"]) and len(shown) > len(hr["text"])
    p.el("stop").click()
    p.idle()
    hs = p.shows(restored)
    assert hr["position"] < hs["position"] < hr["position"] + LONG and hs["text"].startswith(shown)
    assert p.el("last").text.startswith("stopped: the server kept")

    if path := os.environ.get("LINSTREAM_PLAYGROUND_SCREENSHOT"):
        browser.save_screenshot(path)


SSE_SCRIPT = """
const done = arguments[arguments.length - 1];
import("/static/api.js").then(async ({sseFrames}) => {
  const bytes = new TextEncoder().encode(arguments[0]);
  const cuts = [[1]];  // one byte at a time, then every two-piece split
  for (let i = 1; i < bytes.length; i++) cuts.push([i, bytes.length]);
  const out = [];
  for (const cut of cuts) {
    const pieces = [];
    if (cut.length === 1) for (const b of bytes) pieces.push(new Uint8Array([b]));
    else pieces.push(bytes.slice(0, cut[0]), bytes.slice(cut[0]));
    const body = new ReadableStream({start(c) { pieces.forEach((p) => c.enqueue(p)); c.close(); }});
    const frames = [];
    for await (const f of sseFrames(body)) frames.push([f.event, f.data]);
    out.push(frames);
  }
  done(out);
}).catch((e) => done(String(e)));
"""


def test_sse_frames_however_the_bytes_are_cut(browser, server):
    """The page's SSE parser, in the browser, on what sse-starlette sends (\\r\\n line ends, ping
    comments, UTF-8), cut into pieces at every byte."""
    browser.get(server.url + "/")
    wire = ('event: token\r\ndata: {"text": "é\\\\n"}\r\n\r\n: ping - 2026-12-01\r\n\r\n'
            'event: done\r\ndata: {"finish_reason": "length"}\r\n\r\ndata: [DONE]\r\n\r\n')
    want = [["token", '{"text": "é\\\\n"}'], ["done", '{"finish_reason": "length"}'], ["message", "[DONE]"]]
    results = browser.execute_async_script(SSE_SCRIPT, wire)
    assert isinstance(results, list) and len(results) == len(wire.encode())
    assert all(r == want for r in results)
