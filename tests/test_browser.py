"""End to end in a real browser: JupyterLab and Notebook 7 run notebooks in headless Chromium.

Checks what only a browser can: every view of notebooks/01_views_tour.ipynb draws (plotly
figures exist, one tensor panel per rank), no widget fails to display, and a saved notebook
reopened without its kernel still shows each view's static copy; the tour draws in Notebook 7
too (its /notebooks/... page); and the README's scenes (tests/browser_scenes.py) draw, saved
as PNGs when LABKIT_SCREENSHOTS names a folder. One Jupyter server serves every test (each
in a folder of its own; `jupyter lab` serves Notebook 7's pages as well). And Run All, which
stops at the first error whatever a cell's tags say, reaches the end of the notebook that
shows the most failures (15: four failures, each a stuck cell and a restart), leaving no live
status behind. The copy it runs has no `raises-exception` tags: JupyterLab 4.6 runs on past a
tagged cell's error, but other frontends (and older JupyterLab) stop there, so the notebook
must not rely on it.

Only notebook 15 runs here, as the costliest (about a minute in a browser); the other notebooks
that show failures (00, 11, 33) are covered without a browser: tests/test_errors.py checks that
no cell carries the `raises-exception` tag (the only way an error could pass nbclient), so
tests/test_notebooks.py, which runs every notebook with nbclient, is Run All for them.
Screenshots go to artifacts/ when a step fails. Skips (with the reason) when /usr/bin/chromium
or the playwright package is missing; never runs `playwright install`.
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
import urllib.error
import urllib.request
from collections.abc import Iterator

import nbformat
import pytest
from browser_scenes import SCENE_SETUP, SCENES, Scene

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = "01_views_tour.ipynb"
FAILURES = "15_when_things_go_wrong.ipynb"  # the notebook that shows the most failures
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = os.path.join(ROOT, "artifacts")
RUN_TIMEOUT_MS = 180_000  # Run All of notebook 01: 120 s in CI-like run C8 at load 12-17 on 2 cores

pytestmark = pytest.mark.browser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, str, str]]:
    """One Jupyter server for the module's tests: (base url, token, its notebook directory).

    `jupyter lab` serves Notebook 7 too (/tree, /notebooks/...: the `notebook` package is a
    server extension), so both frontends share it; each test gets a folder of its own."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (CI installs Debian's chromium)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    tmp = tmp_path_factory.mktemp("jupyter")
    work = tmp / "nb"
    work.mkdir()
    token, port = secrets.token_hex(16), _free_port()
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    # No keep-alive pings on the kernels' websockets: on a saturated 2-core machine the server
    # missed the browser's pong for 90 s and closed the socket, and JupyterLab's reconnect
    # dropped the cells queued by Run All (a browser and a server on one machine need no
    # keep-alive; Jupyter's default is to ping every 30 s)
    config = tmp / "jupyter_server_config.json"
    config.write_text(json.dumps({"ServerApp": {"tornado_settings": {"ws_ping_interval": 0}}}))
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--IdentityProvider.token={token}",
        "--ServerApp.ip=127.0.0.1", f"--port={port}", f"--notebook-dir={work}",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--config={config}",
    ]  # fmt: skip
    if os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    log = open(tmp / "jupyter.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited ({proc.returncode}); see {tmp}/jupyter.log")
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("jupyter lab did not answer within 60 s")
                time.sleep(0.3)
        yield base, token, str(work)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture
def jupyter(request, server) -> Iterator[tuple[str, str]]:
    """A copy of the notebook (NOTEBOOK, or the test's parameter; a parameter (name, "notebook")
    opens it in Notebook 7 instead of JupyterLab) in a folder of the test's own on the shared
    server: (the notebook's url, its path on disk). Its kernels are shut down afterwards."""
    param = getattr(request, "param", NOTEBOOK)
    name, frontend = param if isinstance(param, tuple) else (param, "lab")
    base, token, work = server
    folder = request.node.name.split("[")[0]
    os.makedirs(os.path.join(work, folder))
    path = os.path.join(work, folder, name)
    if os.path.exists(os.path.join(ROOT, "notebooks", name)):
        shutil.copy(os.path.join(ROOT, "notebooks", name), path)
    # a JupyterLab workspace of the test's own: the shared default one would reopen the tabs
    # of the tests before (each starting its kernel)
    where = f"lab/workspaces/{folder}/tree" if frontend == "lab" else "notebooks"
    try:
        yield f"{base}/{where}/{folder}/{name}?token={token}", path
    finally:
        _shutdown_kernels(f"{base}/?token={token}", every=True)


def _code_cells(page):  # the notebook's code cells, in order
    return page.locator(".jp-Notebook .jp-CodeCell")


def _wait_all_ran(page, count: int, timeout_ms: int = RUN_TIMEOUT_MS) -> None:
    """Every code cell shows an execution count ([n], not [*] or [ ])."""
    page.wait_for_function(
        """(count) => {
            const cells = '.jp-Notebook .jp-CodeCell .jp-InputPrompt';
            const prompts = [...document.querySelectorAll(cells)];
            return prompts.length === count && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }""",
        arg=count,
        timeout=timeout_ms,
    )


def _cell_with(page, text: str):
    """The code cell whose source contains `text`."""
    return _code_cells(page).filter(has=page.locator(".jp-InputArea", has_text=text))


def _open(page, url: str) -> None:
    """Open the notebook and wait until its one kernel is connected and idle."""
    page.goto(url)
    page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=60_000)
    base, token = _base(url)
    lab = "/lab/" in url  # Notebook 7 has no execution indicator in its status bar
    deadline = time.monotonic() + 60
    while True:  # JupyterLab may start (and drop) a kernel or two while it settles
        states = _states(url)
        indicator = ".jp-Notebook-ExecutionIndicator[data-status='idle']"
        idle = not lab or page.locator(indicator).count()
        if states == ["idle"] and idle:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the notebook's kernel did not settle: {states}")
        time.sleep(0.5)
    page.wait_for_timeout(1000)


def _base(url: str) -> tuple[str, str]:
    """(the server's base url, the token) of a notebook's url."""
    return "/".join(url.split("/")[:3]), url.split("token=")[1]


def _api(base: str, token: str, what: str) -> list:
    with urllib.request.urlopen(f"{base}/api/{what}?token={token}", timeout=10) as r:
        return json.load(r)


@pytest.mark.timeout(420)
def test_views_tour_renders_and_survives_reopening(jupyter) -> None:
    from playwright.sync_api import sync_playwright

    url, path = jupyter
    with open(path) as f:
        num_code = sum(c["cell_type"] == "code" for c in json.load(f)["cells"])
    with sync_playwright() as pw:
        browser = _launch(pw)
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("jupyter", [(NOTEBOOK, "notebook")], indirect=True)
def test_views_tour_renders_in_notebook_7(jupyter) -> None:
    """The same tour in Notebook 7 (`jupyter notebook`, the /notebooks/... page): every view
    draws and no widget fails to display."""
    from playwright.sync_api import sync_playwright

    pytest.importorskip("notebook", minversion="7", reason="Notebook 7 (the lab extra) is missing")

    url, path = jupyter
    with open(path) as f:
        num_code = sum(c["cell_type"] == "code" for c in json.load(f)["cells"])
    with sync_playwright() as pw:
        browser = _launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        step = "notebook7 open"
        try:
            _open(page, url)
            assert "/notebooks/" in page.url and "/lab" not in page.url, page.url  # no redirect
            step = "notebook7 run all"
            _run_all(page)
            _wait_all_ran(page, num_code, timeout_ms=150_000)
            step = "notebook7 views"
            notebook = page.locator(".jp-Notebook")
            tensors = _cell_with(page, "show_tensors").locator(".jp-OutputArea")
            tensors.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=30_000)
            assert tensors.locator(".js-plotly-plot").count() == 2  # one panel per rank
            for call in ("show_timeline", "show_comm", "show_placement"):
                out = _cell_with(page, call).locator(".jp-OutputArea")
                out.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=30_000)
            text = notebook.inner_text()
            assert "Error displaying widget" not in text and "Traceback" not in text
            copies = notebook.locator(".labkit-static-copy")  # hidden here too
            assert copies.count() == 4
            assert not any(copies.nth(i).is_visible() for i in range(4))
        except BaseException:
            _screenshot(page, step)
            raise
        finally:
            browser.close()


def _scenes_notebook(path: str) -> list[tuple[Scene, int]]:
    """Write the scenes' notebook; each scene with the index of the code cell to capture."""
    cells, marks = [nbformat.v4.new_code_cell(src) for src in SCENE_SETUP], []
    for scene in SCENES:
        cells += [nbformat.v4.new_code_cell(src) for src in scene.cells]
        if scene.raises:
            cells[-1].metadata["tags"] = ["raises-exception"]
        marks.append((scene, len(cells) - 1))
    nb = nbformat.v4.new_notebook(cells=cells)
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["kernelspec"] = kernel
    nbformat.write(nb, path)
    return marks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("jupyter", [("scenes.ipynb", "lab")], indirect=True)
def test_scenes_draw_and_are_captured(jupyter) -> None:
    """The README's scenes (tests/browser_scenes.py) draw in JupyterLab; with
    LABKIT_SCREENSHOTS=folder each captured output is saved there as a PNG."""
    from playwright.sync_api import sync_playwright

    url, path = jupyter
    marks = _scenes_notebook(path)
    folder = os.environ.get("LABKIT_SCREENSHOTS")
    with sync_playwright() as pw:
        browser = _launch(pw)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        step = "scenes open"
        try:
            _open(page, url)
            page.add_style_tag(content=".Toastify {display: none !important}")  # news toasts
            page.keyboard.press("Control+b")  # hide the file browser: the cells get its width
            step = "scenes run all"
            _run_all(page)
            for scene, _ in marks:
                step = f"scene {scene.name}: typing its answers"
                for answer in scene.answers:  # pdb's prompts come as the notebook's input box
                    _answer_input(page, answer)
            _wait_all_ran(page, marks[-1][1] + 1, timeout_ms=150_000)
            page.mouse.move(0, 0)  # no hover labels or mode bars in the pictures
            for scene, index in marks:
                step = f"scene {scene.name}"
                cell = _code_cells(page).nth(index)
                cell.scroll_into_view_if_needed()
                out = cell if scene.whole_cell else cell.locator(".jp-OutputArea")
                if scene.plots:
                    _wait_plots_drawn(page, cell.locator(".jp-OutputArea"), scene.plots)
                text = cell.locator(".jp-OutputArea").inner_text()
                assert scene.expect in text, f"{scene.name}: {scene.expect!r} not in {text!r}"
                assert "Error displaying widget" not in text, scene.name
                if folder:
                    page.wait_for_timeout(300)  # plotly's transitions end
                    png = os.path.join(folder, f"{scene.name}.png")
                    os.makedirs(folder, exist_ok=True)
                    out.screenshot(path=png, animations="disabled")
                    size = os.path.getsize(png)
                    assert size < 150_000, f"{png} is {size} bytes: make the scene smaller"
        except BaseException:
            _screenshot(page, step)
            raise
        finally:
            browser.close()


def _answer_input(page, text: str) -> None:
    """Type `text` into the input box a cell opened (input(), pdb on a rank), then wait until
    that box is answered (JupyterLab replaces it with the line typed)."""
    box = page.locator(".jp-Stdin-input").first
    box.wait_for(state="visible", timeout=150_000)
    handle = box.element_handle()
    box.fill(text)
    box.press("Enter")
    page.wait_for_function("box => !box.isConnected", arg=handle, timeout=60_000)


def _wait_plots_drawn(page, area, count: int) -> None:
    """Wait until `area` holds `count` plotly figures, each drawn with its data (a figure
    widget first draws empty axes, then its traces)."""
    page.wait_for_function(
        """([area, count]) => {
            const plots = [...area.querySelectorAll('.js-plotly-plot')];
            return plots.length === count && plots.every(
                p => p.data && p.data.length > 0 && p.querySelector('.main-svg'));
        }""",
        arg=[area.element_handle(), count],
        timeout=30_000,
    )


def _run_all(page) -> None:
    """Run > Run All Cells (the same menu in JupyterLab and Notebook 7)."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def _launch(pw):
    return pw.chromium.launch(
        executable_path=CHROMIUM,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ],
    )


def _wait_run_all_done(url: str, timeout: float) -> None:
    """Wait until Run All is over: the kernel was busy, then idle for 5 s on end (it is idle
    only for a moment between queued cells). Which cells ran is read from the saved file: the
    notebook draws only the cells on screen, so the page cannot tell."""
    base, token = _base(url)
    deadline, busy, idle_since = time.monotonic() + timeout, False, None
    while True:
        states = _states(url)
        busy = busy or states == ["busy"]
        idle_since = (idle_since or time.monotonic()) if busy and states == ["idle"] else None
        if idle_since and time.monotonic() - idle_since > 5:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Run All did not end in {timeout} s")
        time.sleep(0.5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("jupyter", [FAILURES], indirect=True)
def test_run_all_reaches_the_end_of_the_failures_notebook(jupyter) -> None:
    from playwright.sync_api import sync_playwright

    url, path = jupyter
    with open(path) as f:
        nb = json.load(f)
    for cell in nb["cells"]:  # as a frontend that ignores the tag (JupyterLab 4.6 honours it)
        tags = cell["metadata"].get("tags", [])
        cell["metadata"]["tags"] = [t for t in tags if t != "raises-exception"]
    with open(path, "w") as f:
        json.dump(nb, f)
    with sync_playwright() as pw:
        browser = _launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        step = "open"
        try:
            _open(page, url)
            step = "run all"
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            _wait_run_all_done(url, timeout=240)
            assert page.locator(".jp-Notebook .lk-live").count() == 0  # none left on screen
            step = "save"
            page.keyboard.press("Control+s")
            page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=30_000)
        except BaseException:
            _screenshot(page, step)
            raise
        finally:
            browser.close()
    with open(path) as f:
        saved = f.read()
    code = [c for c in json.loads(saved)["cells"] if c["cell_type"] == "code"]
    ran = [c for c in code if c["execution_count"] is not None]
    assert len(ran) == len(code), f"Run All stopped after {len(ran)} of {len(code)} code cells"
    assert "rank 2 died (killed by signal SIGKILL)" in saved  # the last failure was shown
    assert "lk-live" not in saved and "running for" not in saved  # nothing stale was saved


def _notebook_path(url: str) -> str:
    """The notebook's path on the server, as its sessions name it."""
    path = url.split("?")[0]
    return path.split("/tree/", 1)[1] if "/lab/" in path else path.split("/notebooks/", 1)[1]


def _states(url: str) -> list[str]:
    """The execution states of the kernels of this notebook's sessions (the server is shared)."""
    base, token = _base(url)
    path = _notebook_path(url)
    sessions = _api(base, token, "sessions")
    return [s["kernel"]["execution_state"] for s in sessions if s["path"] == path]


def _shutdown_kernels(url: str, every: bool = False) -> None:
    """Shut down this notebook's sessions (`every`: all of the server's), and wait until they
    are gone."""
    base, token = _base(url)
    path = None if every else _notebook_path(url)
    deadline = time.monotonic() + 30
    while True:
        sessions = [s for s in _api(base, token, "sessions") if every or s["path"] == path]
        if not sessions:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"sessions left after shutting them down: {sessions}")
        for s in sessions:
            req = urllib.request.Request(
                f"{base}/api/sessions/{s['id']}?token={token}", method="DELETE"
            )
            try:
                urllib.request.urlopen(req, timeout=30).close()
            except urllib.error.HTTPError as exc:  # gone meanwhile
                if exc.code != 404:
                    raise
        time.sleep(0.5)


def _screenshot(page, step: str) -> None:
    os.makedirs(ARTIFACTS, exist_ok=True)
    name = os.path.join(ARTIFACTS, f"browser-{step.replace(' ', '-')}.png")
    try:
        page.screenshot(path=name, full_page=True)
        print(f"screenshot: {name}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - a failed screenshot must not hide the failure
        print(f"screenshot failed: {exc}", file=sys.stderr)
