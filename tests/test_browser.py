"""End to end in a real browser: JupyterLab runs notebooks/01_views_tour.ipynb in headless Chromium.

Checks what only a browser can: every view draws (plotly figures exist, one tensor panel per
rank), no widget fails to display, and a saved notebook reopened without its kernel still shows
each view's static copy. Screenshots go to artifacts/ when a step fails. Skips (with the reason)
when /usr/bin/chromium or the playwright package is missing; never runs `playwright install`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = "01_views_tour.ipynb"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = os.path.join(ROOT, "artifacts")
RUN_TIMEOUT_MS = 90_000

pytestmark = pytest.mark.browser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter(tmp_path) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on a copy of the notebook: (base url, notebook path on disk)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (CI installs Debian's chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    work = tmp_path / "nb"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "notebooks", NOTEBOOK), work / NOTEBOOK)
    token, port = secrets.token_hex(16), _free_port()
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--IdentityProvider.token={token}",
        "--ServerApp.ip=127.0.0.1", f"--port={port}", f"--notebook-dir={work}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    if os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyter.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited ({proc.returncode}); see {tmp_path}/jupyter.log")
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("jupyter lab did not answer within 60 s")
                time.sleep(0.3)
        yield f"{base}/lab/tree/{NOTEBOOK}?token={token}", str(work / NOTEBOOK)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _code_cells(page):  # the notebook's code cells, in order
    return page.locator(".jp-Notebook .jp-CodeCell")


def _wait_all_ran(page, count: int) -> None:
    """Every code cell shows an execution count ([n], not [*] or [ ])."""
    page.wait_for_function(
        """(count) => {
            const cells = '.jp-Notebook .jp-CodeCell .jp-InputPrompt';
            const prompts = [...document.querySelectorAll(cells)];
            return prompts.length === count && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }""",
        arg=count,
        timeout=RUN_TIMEOUT_MS,
    )


def _cell_with(page, text: str):
    """The code cell whose source contains `text`."""
    return _code_cells(page).filter(has=page.locator(".jp-InputArea", has_text=text))


def _open(page, url: str) -> None:
    """Open the notebook and wait until its one kernel is connected and idle."""
    page.goto(url)
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
    base, token = url.split("/lab/")[0], url.split("token=")[1]
    deadline = time.monotonic() + 60
    while True:  # JupyterLab may start (and drop) a kernel or two while it settles
        sessions = _api(base, token, "sessions")
        states = [s["kernel"]["execution_state"] for s in sessions]
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count()
        if states == ["idle"] and idle:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the notebook's kernel did not settle: {states}")
        time.sleep(0.5)
    page.wait_for_timeout(1000)


def _api(base: str, token: str, what: str) -> list:
    with urllib.request.urlopen(f"{base}/api/{what}?token={token}", timeout=10) as r:
        return json.load(r)


@pytest.mark.timeout(240)
def test_views_tour_renders_and_survives_reopening(jupyter) -> None:
    from playwright.sync_api import sync_playwright

    url, path = jupyter
    with open(path) as f:
        num_code = sum(c["cell_type"] == "code" for c in json.load(f)["cells"])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        step = "open"
        try:
            _open(page, url)
            step = "run all"
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            _wait_all_ran(page, num_code)

            step = "live views"
            notebook = page.locator(".jp-Notebook")
            assert "Error displaying widget" not in notebook.inner_text()
            assert "Traceback" not in notebook.inner_text()
            tensors = _cell_with(page, "show_tensors").locator(".jp-OutputArea")
            tensors.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
            assert tensors.locator(".js-plotly-plot").count() == 2  # one panel per rank
            for call in ("show_timeline", "show_comm", "show_placement"):
                out = _cell_with(page, call).locator(".jp-OutputArea")
                out.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
                # plotly really drew: the figure has its SVG layer with marks in it
                assert out.locator(".plot-container .main-svg").count() >= 1, call
            assert notebook.locator(".js-plotly-plot .plot-container").count() >= 5
            # each view's static copy is in the output, hidden while its live widget renders
            copies = notebook.locator(".labkit-static-copy")
            assert copies.count() == 4
            assert not any(copies.nth(i).is_visible() for i in range(4))

            step = "save"
            page.keyboard.press("Control+s")
            page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=30_000)
            browser.close()
        except BaseException:
            _screenshot(page, step)
            browser.close()
            raise

        with open(path) as f:
            saved = json.load(f)
        html_outputs = [
            o["data"]["text/html"]
            for c in saved["cells"]
            for o in c.get("outputs", [])
            if "text/html" in o.get("data", {})
        ]
        for kind in ("tensors", "timeline", "comm", "placement"):
            assert any(f"labkit-{kind}" in "".join(h) for h in html_outputs), kind

        # Reopen in a fresh browser; the kernel that made the widgets is gone (the lab was
        # stopped and a new page starts its own kernel), so only the static copies can show.
        _shutdown_kernels(url)
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        step = "reopen"
        try:
            _open(page, url)
            for kind in ("tensors", "timeline", "comm", "placement"):
                static = page.locator(f".jp-Notebook .labkit-static-copy .labkit-{kind}").first
                static.wait_for(state="visible", timeout=30_000)
                assert static.locator("table, p").count() >= 1, kind
        except BaseException:
            _screenshot(page, step)
            raise
        finally:
            browser.close()


def _shutdown_kernels(url: str) -> None:
    base, token = url.split("/lab/")[0], url.split("token=")[1]
    for s in _api(base, token, "sessions"):
        req = urllib.request.Request(
            f"{base}/api/sessions/{s['id']}?token={token}", method="DELETE"
        )
        urllib.request.urlopen(req, timeout=30).close()


def _screenshot(page, step: str) -> None:
    os.makedirs(ARTIFACTS, exist_ok=True)
    name = os.path.join(ARTIFACTS, f"browser-{step.replace(' ', '-')}.png")
    try:
        page.screenshot(path=name, full_page=True)
        print(f"screenshot: {name}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - a failed screenshot must not hide the failure
        print(f"screenshot failed: {exc}", file=sys.stderr)
