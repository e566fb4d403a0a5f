"""Sphinx configuration of the course site; `python3 scripts/dev.py docs` builds it (see
site.md). scripts/build_site.py copies this file beside the pages and the executed notebooks."""

from __future__ import annotations

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

project = "labkit"
author = "labkit's authors"
extensions = ["myst_nb", "sphinx.ext.autodoc"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "labkit: learn PyTorch parallelism in a notebook"
html_static_path = ["_static"]
html_js_files = ["plotly.min.js"]  # the plotly package's own copy: the figures draw offline
html_theme_options = {"nosidebar": False, "page_width": "1200px", "sidebar_width": "260px"}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}

myst_heading_anchors = 3  # links such as magics.md#outside-jupyterlab
myst_enable_extensions = ["colon_fence"]
nb_execution_mode = "off"  # never executed here: CI's executed copies are rendered
nb_merge_streams = True
nb_output_stderr = "show"
suppress_warnings = ["mystnb.unknown_mime_type"]  # none left after scripts/build_site.py; kept safe

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"undoc-members": False}


class LabkitMagics(SphinxDirective):
    """`%lab?` and `%%ranks?` as IPython prints them: the magics' docstrings and arguments."""

    def run(self) -> list[nodes.Node]:
        from labkit.kernel.magics import LabMagics

        out: list[nodes.Node] = []
        for title, fn in (("%lab", LabMagics.lab), ("%%ranks", LabMagics.ranks)):
            out.append(nodes.rubric(text=title))
            text = "\n".join(line.rstrip() for line in (fn.__doc__ or "").splitlines())
            out.append(nodes.literal_block(text, text))
        return out


def setup(app):  # noqa: ANN001, ANN201 - Sphinx's hook
    app.add_directive("labkit-magics", LabkitMagics)
    return {"parallel_read_safe": True}
