"""The operator dashboard (``GET /dashboard``, router/edge/dashboard.py) and the summary it draws
(``GET /admin/summary``), against a real gateway over two `kvroute sim` workers (policy ttft)
driven by the ``openai`` SDK; the page in a real browser: headless Chromium (Debian's
``chromium``; ``KVR_CHROMIUM`` names another binary) driven by Playwright for Python.

In the browser: a wrong admin token is refused with a message and asked again; both workers are
listed, each with its role, which follows ``PUT /admin/workers/{id}/role``; the decisions table
lists the request ids sent, each with the worker named in its ``x-kvroute-worker`` header; the numbers move as traffic flows (waited on as page conditions,
never slept); the explain box shows a pasted body's decision; a hostile request id shows as text.
The last test saves a screenshot (``tmp_path``, and ``$KVR_SCREENSHOT_DIR`` when set).

Every test makes the traffic it checks, so any one also runs alone (``-k``). No test skips: a
missing Chromium fails, naming the package to install.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from playwright.sync_api import Page, expect, sync_playwright

from conftest import ADMIN_TOKEN
from test_gateway_e2e import assert_openai_error, chat_body, running_two_sim_gateway

WAIT_MS = 30_000  # the longest any page condition may take (a busy CI machine)
TOKEN_KEY = "kvroute.adminToken"  # the page's sessionStorage key
VIEWPORT = {"width": 1440, "height": 1000}


def chromium_path() -> str:
    """The Chromium binary: ``$KVR_CHROMIUM``, else ``chromium`` (Debian) or a namesake on PATH."""
    for candidate in (os.environ.get("KVR_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        found = candidate and shutil.which(candidate)
        if found:
            return found
    pytest.fail("no Chromium on PATH: `apt-get install -y chromium` (Debian), or set KVR_CHROMIUM")


@pytest.fixture(scope="module")
def gw(tmp_path_factory, tiny_model):
    with running_two_sim_gateway(tmp_path_factory, tiny_model, "dashboard", load_scrape={"interval_s": 0.5}) as (base, _, _):
        yield base


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        # root in a container has no user namespace for Chromium's sandbox
        b = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh tab (its own sessionStorage); any uncaught script error in it fails the test."""
    context = browser.new_context(viewport=VIEWPORT)
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert errors == [], errors


def client(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="sk-client-key", max_retries=0, timeout=60)


def send(base: str, rid: str, conv: str, question: str = "q1") -> str:
    """One chat request with ``x-request-id: rid``; the worker it went to (``x-kvroute-worker``)."""
    r = client(base).chat.completions.with_raw_response.create(**chat_body(conv, question),
                                                               extra_headers={"x-request-id": rid})
    r.parse()
    return r.headers["x-kvroute-worker"]


def admin_get(base: str, path: str, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(base + path, headers=headers, timeout=30)


def sign_in(page: Page, base: str, token: str = ADMIN_TOKEN) -> None:
    """Open the dashboard and enter ``token`` in its form."""
    page.goto(base + "/dashboard")
    expect(page.locator("#token-input")).to_be_visible()
    page.fill("#token-input", token)
    page.click("#token-submit")


def wait_for_value(page: Page, element_id: str, at_least: float) -> float:
    """Wait until the page's ``#element_id`` shows a number (its ``data-value``) >= ``at_least``."""
    page.wait_for_function("([id, n]) => Number(document.getElementById(id).dataset.value) >= n",
                           arg=[element_id, at_least])
    return float(page.locator(f"#{element_id}").get_attribute("data-value"))


def decision_row(page: Page, rid: str):
    return page.locator(f'#decisions tbody tr[data-request-id="{rid}"]')


# ---- the page and the summary over HTTP --------------------------------------------------------
def test_the_page_needs_no_token_and_fetches_nothing_from_elsewhere(gw):
    r = httpx.get(gw + "/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp) and "unsafe-inline" not in csp
    assert r.headers["cache-control"] == "no-store" and r.headers["x-content-type-options"] == "nosniff"
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", r.text)  # no CDN, no remote font
    assert "innerHTML" not in r.text and "insertAdjacentHTML" not in r.text and "document.write" not in r.text


def test_summary_counts_the_recent_decisions(gw):
    assert_openai_error(admin_get(gw, "/admin/summary", token=None), 401)
    before = admin_get(gw, "/admin/summary").json()
    sent = [send(gw, f"sum-{i}", "summary-conv", f"question {i}") for i in range(3)]
    got = admin_get(gw, "/admin/summary?window_s=60&bucket_s=5").json()
    assert (got["window_s"], got["bucket_s"], len(got["series"])) == (60, 5, 12)
    assert got["recorded"] == before["recorded"] + 3 and got["kept"] == 1024
    assert sum(b["decisions"] for b in got["series"]) == got["totals"]["decisions"] >= 3
    for worker in set(sent):
        assert got["by_worker"][worker] >= sent.count(worker)
    assert sum(got["by_reason"].values()) == got["totals"]["decisions"]
    assert got["by_reason"].get("prefix_hit", 0) >= 1  # the 2nd and 3rd share the 1st's system prompt
    totals = got["totals"]
    assert totals["reported"] >= 3 and totals["actual_cached_tokens"] > 0
    assert math.isclose(got["hit_rate"], totals["actual_cached_tokens"] / totals["prompt_tokens"], abs_tol=1e-4)
    starts = [b["start_unix_s"] for b in got["series"]]
    assert starts == [starts[0] + 5 * i for i in range(12)] and starts[0] % 5 == 0  # on multiples of 5 s
    assert starts[-1] <= got["now_unix_s"] < starts[-1] + 5
    for query, param in (("window_s=0", "window_s"), ("window_s=nan", "window_s"), ("window_s=7200", "window_s"),
                         ("bucket_s=0", "bucket_s"), ("window_s=60&bucket_s=120", "bucket_s"),
                         ("window_s=3600&bucket_s=1", "bucket_s"), ("bucket_s=soon", "bucket_s")):
        assert assert_openai_error(admin_get(gw, "/admin/summary?" + query), 400)["param"] == param, query


# ---- the page in Chromium ----------------------------------------------------------------------
def test_a_wrong_token_is_refused_and_asked_again(gw, page):
    sign_in(page, gw, "not-the-token")
    error = page.locator("#auth-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("refused the admin token")
    expect(page.locator("#main")).to_be_hidden()
    assert page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") is None  # nothing wrong is kept
    page.fill("#token-input", ADMIN_TOKEN)
    page.click("#token-submit")
    expect(page.locator("#main")).to_be_visible()
    expect(error).to_be_hidden()
    # a kept token the gateway stops accepting (rotated) brings the form back, saying why
    page.evaluate(f"sessionStorage.setItem('{TOKEN_KEY}', 'rotated-away')")
    page.reload()
    expect(error).to_contain_text("refused the admin token")
    expect(page.locator("#main")).to_be_hidden()


def test_workers_and_decisions_are_shown_and_move_with_traffic(gw, page):
    first = {f"dash-{i}": send(gw, f"dash-{i}", f"dash-conv-{i % 3}", f"q{i}") for i in range(6)}
    sign_in(page, gw)
    expect(page.locator("#policy-name")).to_have_text("ttft")
    workers = page.locator("#workers tbody tr[data-worker]")
    expect(workers).to_have_count(2)
    assert [workers.nth(i).get_attribute("data-worker") for i in range(2)] == ["w0", "w1"]
    expect(page.locator("#workers tbody .status")).to_have_text(["up", "up"])
    for rid, worker in first.items():
        expect(decision_row(page, rid).locator(".chosen-worker")).to_have_text(worker)
    # the three repeated conversations hit their prefixes: the reasons panel and hit rate say so
    expect(page.locator('#reasons [data-reason="prefix_hit"] .count')).to_have_text(re.compile(r"^[1-9]"))
    assert wait_for_value(page, "stat-hit", 0.01) <= 1
    recorded = wait_for_value(page, "stat-decisions", len(first))
    per_worker = {w: int(page.locator(f'#workers tr[data-worker="{w}"] .requests').inner_text()) for w in ("w0", "w1")}

    more = {f"dash-more-{i}": send(gw, f"dash-more-{i}", f"dash-conv-{i}", "again") for i in range(4)}
    wait_for_value(page, "stat-decisions", recorded + len(more))
    for rid, worker in more.items():
        expect(decision_row(page, rid).locator(".chosen-worker")).to_have_text(worker)
    for w in ("w0", "w1"):  # the per-worker request counts moved by exactly the new traffic
        want = per_worker[w] + sum(1 for x in more.values() if x == w)
        expect(page.locator(f'#workers tr[data-worker="{w}"] .requests')).to_have_text(str(want))
    # newest first: the last request sent heads the table
    expect(page.locator("#decisions tbody tr").first).to_have_attribute("data-request-id", "dash-more-3")
    # each decision lists both candidates with their matched blocks, load and cost
    expect(decision_row(page, "dash-more-3").locator("table.cands tr")).to_have_count(2)
    # and the gateway's own time before the send, as /admin/decisions has it
    logged = next(d for d in admin_get(gw, "/admin/decisions").json()["decisions"] if d["request_id"] == "dash-more-3")
    cell = decision_row(page, "dash-more-3").locator(".gateway-ms")
    expect(cell).to_have_text(re.compile(r"^\d+\.\d$"))  # one decimal, as the page rounds it
    assert abs(float(cell.inner_text()) - logged["gateway_ms"]) <= 0.05 + 1e-9


def test_the_workers_table_shows_each_role_as_it_changes(gw, page):
    sign_in(page, gw)
    expect(page.locator("#workers thead")).to_contain_text("role")
    expect(page.locator("#workers tbody .role")).to_have_text(["both", "both"])
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        r = httpx.put(gw + "/admin/workers/w1/role", json={"role": "decode"}, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        expect(page.locator('#workers tr[data-worker="w1"] .role')).to_have_text("decode")
        expect(page.locator('#workers tr[data-worker="w0"] .role')).to_have_text("both")
    finally:
        assert httpx.put(gw + "/admin/workers/w1/role", json={"role": "both"}, headers=headers,
                         timeout=30).status_code == 200
    expect(page.locator('#workers tr[data-worker="w1"] .role')).to_have_text("both")


def test_the_explain_box_shows_the_decision_for_a_pasted_body(gw, page):
    send(gw, "explain-warm", "explain-conv")
    body = chat_body("explain-conv", "a follow-up question")
    api = httpx.post(gw + "/admin/explain", json=body, timeout=30,
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    sign_in(page, gw)
    expect(page.locator("#explain-body")).not_to_have_value("")  # seeded with an example body
    page.fill("#explain-body", json.dumps(body, indent=2))
    page.click("#explain-run")
    chosen = page.locator("#explain-result .explain-chosen")
    expect(chosen).to_have_text(re.compile(r"^w[01]$"))
    rows = page.locator("#explain-result table.explain-candidates tbody tr")
    expect(rows).to_have_count(2)
    assert sorted(rows.nth(i).get_attribute("data-worker") for i in range(2)) == ["w0", "w1"]
    expect(page.locator("#explain-result tr.is-chosen")).to_have_attribute("data-worker", chosen.inner_text())
    expect(page.locator("#explain-result .kv")).to_contain_text(f"prompt tokens{api['prompt_tokens']:,}")
    expect(page.locator("#explain-result .reason")).to_have_text(re.compile(r"^[a-z_]+$"))
    page.fill("#explain-body", "{not json")
    page.click("#explain-run")
    expect(page.locator("#explain-result .error")).to_contain_text("Not valid JSON")
    page.fill("#explain-body", json.dumps({**body, "model": "no-such-model"}))
    page.click("#explain-run")
    expect(page.locator("#explain-result .error")).to_contain_text("404")


def test_a_hostile_request_id_is_shown_as_text(gw, page):
    rid = """<img src=x onerror="window.kvrPwned=1"><script>window.kvrPwned=2</script>&amp;"""
    worker = send(gw, rid, "hostile-conv")
    sign_in(page, gw)
    page.wait_for_function(
        "rid => [...document.querySelectorAll('#decisions tbody tr')].some(tr => tr.dataset.requestId === rid)",
        arg=rid)
    shown = page.evaluate("""rid => {
        const tr = [...document.querySelectorAll('#decisions tbody tr')].find(t => t.dataset.requestId === rid);
        return {text: tr.querySelector('.rid').textContent, worker: tr.querySelector('.chosen-worker').textContent,
                imgs: document.querySelectorAll('#decisions img, #decisions script').length,
                pwned: window.kvrPwned === undefined ? null : window.kvrPwned};
    }""", rid)
    assert shown == {"text": rid, "worker": worker, "imgs": 0, "pwned": None}


def test_screenshot(gw, page, tmp_path):
    """A full-page screenshot of the dashboard with traffic on it, kept as an artifact."""
    for i in range(8):
        send(gw, f"shot-{i}", f"shot-conv-{i % 2}", f"question {i}")
    sign_in(page, gw)
    expect(decision_row(page, "shot-7")).to_be_visible()
    page.fill("#explain-body", json.dumps(chat_body("shot-conv-0", "one more"), indent=2))
    page.click("#explain-run")
    expect(page.locator("#explain-result .explain-chosen")).to_be_visible()
    page.wait_for_function("() => document.querySelectorAll('#hit-chart circle').length > 0")
    path = tmp_path / "dashboard.png"
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("KVR_SCREENSHOT_DIR"):
        out = Path(os.environ["KVR_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out / "dashboard.png")
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width == VIEWPORT["width"] and height >= 900
