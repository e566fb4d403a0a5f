"""Build the course site (runs in a shell): `python3 scripts/dev.py docs` calls this.

    python scripts/build_site.py [--executed DIR] [--out build/site]

The site is Sphinx with myst-nb (docs/conf.py says why): the docs/ pages, the API reference made
from the docstrings, and the 30 notebooks with their outputs. Nothing is executed here: the
notebooks come from DIR ($LABKIT_EXECUTED_DIR, default build/executed), where the notebook
tests (tests/test_notebooks.py) and `labkit check --save DIR` save each notebook that passed,
with its outputs and widgets' state. A missing or stale one (its code differs from
notebooks/) stops the build with the command that makes it.

Widgets need a live kernel, or JavaScript fetched from a CDN to replay their saved state; the
site does neither. Each view's output becomes what the lab shows, drawn offline: its plotly
figures (from the saved widget state, drawn by the plotly.js that the plotly package carries,
copied once into the site) and, after it, the static HTML copy every view already writes
(its tables). A bare plotly figure becomes the same kind of div.

Sphinx runs with warnings as errors; then every internal link and anchor of the built pages
is checked (`check_links`). External links are not: the build is offline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from typing import Any
from urllib.parse import unquote, urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
NOTEBOOKS = os.path.join(ROOT, "notebooks")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
PAGES = (  # the docs pages, in the site's order
    "api",
    "magics",
    "torchrun",
    "troubleshooting",
    "traces",
    "simulate",
    "gpu",
    "cluster",
    "curriculum",
    "performance",
    "design",
    "layout",
    "references",
    "development",
    "testing",
    "site",
)


def code_of(nb: dict[str, Any]) -> list[str]:
    """The sources of a notebook's code cells: what must match between the executed copy and
    the notebook in notebooks/."""
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def executed_problems(executed: str, names: list[str]) -> list[str]:
    """Why the executed copies cannot be used: missing, or older than the notebook's code."""
    problems = []
    for name in names:
        path = os.path.join(executed, name)
        if not os.path.exists(path):
            problems.append(f"{name}: not in {executed}")
            continue
        with open(path) as f, open(os.path.join(NOTEBOOKS, name)) as g:
            if code_of(json.load(f)) != code_of(json.load(g)):
                problems.append(f"{name}: its code changed since it was executed")
    return problems


# ------------------------------------------------------------------ widgets drawn offline


def figure_div(data: list[Any], layout: dict[str, Any]) -> str:
    """A plotly figure as a div that the site's plotly.js draws (no JavaScript fetched)."""
    import plotly.io as pio

    fig = {"data": data, "layout": layout}
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, validate=False)


def widget_html(model_id: str, state: dict[str, Any], figures_only: bool) -> str:
    """What a saved widget showed: its plotly figures (and, with `figures_only` False, its
    HTML parts), walking its children."""
    model = state.get(model_id)
    if model is None:
        return ""
    s = model.get("state", {})
    if "_widget_data" in s:  # plotly's FigureWidget (anywidget)
        return figure_div(s["_widget_data"], s.get("_widget_layout", {}))
    parts = []
    for output in s.get("outputs", []):  # an Output widget: its own outputs
        parts.append(output_html(output.get("data", {}), state, figures_only))
    if s.get("_model_name") == "HTMLModel" and not figures_only:
        parts.append(s.get("value", ""))
    for child in s.get("children", []):
        parts.append(widget_html(child.removeprefix("IPY_MODEL_"), state, figures_only))
    drawn = "".join(parts)
    if s.get("_model_name") == "HBoxModel" and drawn:  # side by side, as in the lab
        return f"<div style='display:flex;flex-wrap:wrap;gap:8px'>{drawn}</div>"
    return drawn


def output_html(data: dict[str, Any], state: dict[str, Any], figures_only: bool) -> str:
    if PLOTLY_MIME in data:
        return figure_div(data[PLOTLY_MIME].get("data", []), data[PLOTLY_MIME].get("layout", {}))
    if WIDGET_MIME in data:
        return widget_html(data[WIDGET_MIME]["model_id"], state, figures_only)
    return "" if figures_only else data.get("text/html", "")


def static_outputs(nb: dict[str, Any]) -> int:
    """Turn every widget and plotly output of `nb` into HTML (in place); return how many
    figures were drawn. The widget state is dropped afterwards: the page needs none."""
    state = nb.get("metadata", {}).pop("widgets", {}).get(STATE_MIME, {}).get("state", {})
    figures = 0
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_MIME not in data and PLOTLY_MIME not in data:
                continue
            # a view's tables follow it in their own output (its static copy), so a view
            # gives only its figures here; a widget without figures shows its HTML parts
            drawn = output_html(data, state, figures_only=True)
            if not drawn:
                drawn = output_html(data, state, figures_only=False)
            figures += drawn.count("plotly-graph-div")
            if drawn:
                output["data"] = {"text/html": drawn, "text/plain": data.get("text/plain", "")}
            else:
                output["data"] = {"text/plain": data.get("text/plain", "")}
    return figures


# ------------------------------------------------------------------ the source tree


def curriculum_rows() -> list[tuple[str, str]]:
    """(notebook, what it covers) from the README's curriculum table, in order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.findall(r"^\| `(\d\d_\w+)` \| (.*) \|$", text, flags=re.M)


def index_page(names: list[str]) -> str:
    rows = "\n".join(
        f"| [{nb}](notebooks/{nb}.ipynb) | {what} |"
        for nb, what in curriculum_rows()
        if f"{nb}.ipynb" in names
    )
    toc = "\n".join(f"notebooks/{n[:-6]}" for n in names)
    pages = "\n".join(PAGES)
    return f"""# labkit

A lab for learning and debugging PyTorch parallelism from a Jupyter notebook: persistent rank
processes with a `torch.distributed` process group, `%%ranks` cells that run on every rank, and
views of what happened. This site shows the curriculum as it ran in CI (4 CPU ranks with gloo),
with its outputs, plots and tables; to run it yourself, `python3 scripts/dev.py lab` in a clone.

## The curriculum

| notebook | what it covers |
|---|---|
{rows}

```{{toctree}}
:caption: The curriculum
:maxdepth: 1
:hidden:

{toc}
```

```{{toctree}}
:caption: Guides and reference
:maxdepth: 1

{pages}
```
"""


def stage(src: str, executed: str, names: list[str]) -> int:
    """Write the site's source tree into `src`; return the number of figures drawn."""
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(os.path.join(src, "notebooks"))
    os.makedirs(os.path.join(src, "_static"))
    for page in PAGES:
        with open(os.path.join(DOCS, f"{page}.md")) as f:
            text = f.read()
        with open(os.path.join(src, f"{page}.md"), "w") as f:
            f.write(text.replace("](../README.md)", "](index.md)"))
    shutil.copytree(os.path.join(DOCS, "screenshots"), os.path.join(src, "screenshots"))
    shutil.copy(os.path.join(DOCS, "conf.py"), src)
    import plotly

    plotly_js = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    shutil.copy(plotly_js, os.path.join(src, "_static", "plotly.min.js"))
    with open(os.path.join(src, "index.md"), "w") as f:
        f.write(index_page(names))
    figures = 0
    for name in names:
        with open(os.path.join(executed, name)) as f:
            nb = json.load(f)
        figures += static_outputs(nb)
        with open(os.path.join(src, "notebooks", name), "w") as f:
            json.dump(nb, f)
    return figures


# ------------------------------------------------------------------ internal links


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key] or "")
        for key in ("href", "src"):
            if a.get(key) and not (tag == "link" and a.get("rel") == "canonical"):
                self.links.append(a[key] or "")


def check_links(out: str) -> list[str]:
    """Internal links and anchors of the built site that lead nowhere: 'page: link'."""
    pages: dict[str, _Refs] = {}
    for folder, _, files in os.walk(out):
        for name in files:
            if name.endswith(".html"):
                path = os.path.join(folder, name)
                parser = _Refs()
                with open(path, encoding="utf-8") as f:
                    parser.feed(f.read())
                pages[os.path.normpath(path)] = parser
    broken = []
    for path, refs in sorted(pages.items()):
        for link in refs.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue  # external (http, https, mailto, data): not checked offline
            target = path
            if parts.path:
                target = os.path.normpath(os.path.join(os.path.dirname(path), unquote(parts.path)))
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            if not os.path.exists(target):
                broken.append(f"{os.path.relpath(path, out)}: {link} (no such file)")
            elif parts.fragment and target in pages:
                if unquote(parts.fragment) not in pages[target].ids:
                    broken.append(f"{os.path.relpath(path, out)}: {link} (no such anchor)")
    return broken


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = os.environ.get("LABKIT_EXECUTED_DIR") or os.path.join(ROOT, "build", "executed")
    p.add_argument("--executed", default=default, help=f"executed notebooks (default {default})")
    p.add_argument("--out", default=os.path.join(ROOT, "build", "site"))
    p.add_argument(
        "--partial",
        action="store_true",
        help="build with the executed notebooks there are, leaving the others out (a preview)",
    )
    args = p.parse_args(argv)
    executed = os.path.abspath(args.executed)
    names = sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))
    problems = executed_problems(executed, names)
    if problems and args.partial:
        print("left out (--partial):\n  " + "\n  ".join(problems), file=sys.stderr)
        left_out = {p.split(":")[0] for p in problems}
        names, problems = [n for n in names if n not in left_out], []
    if problems:
        print(
            "the course site renders the notebooks as CI executed them, and these are missing "
            "or stale:\n  " + "\n  ".join(problems) + "\nmake them with the notebook tests:\n"
            f"  LABKIT_EXECUTED_DIR={executed} python3 scripts/dev.py test -m slow "
            "tests/test_notebooks.py\nor some of them with `labkit check --save "
            f"{executed} notebooks/NN_name.ipynb ...` (then `--partial` builds a preview)",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    src = os.path.join(ROOT, "build", "site-src")
    figures = stage(src, executed, names)
    shutil.rmtree(args.out, ignore_errors=True)
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    code = subprocess.call([*cmd, "-j", "2", src, args.out])
    if code:
        print("sphinx-build failed (warnings are errors)", file=sys.stderr)
        return code
    broken = check_links(args.out)
    if broken:
        print("broken internal links:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1
    print(
        f"site: {len(names)} notebooks ({figures} figures), {len(PAGES)} pages in "
        f"{time.perf_counter() - t0:.0f} s: {os.path.join(args.out, 'index.html')} "
        "(internal links checked; external ones are not, offline)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
