"""Write notebooks from Python lists of cells (for authors; the .ipynb files are what ships).

    from nbtools import md, code, write
    write("notebooks/00_start.ipynb", [md("# Title"), code("1 + 1"), code("1/0", raises=True)])

Notebooks are written without outputs; CI executes them top to bottom.
"""

from __future__ import annotations

import nbformat


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, raises: bool = False, hide: bool = False) -> nbformat.NotebookNode:
    """A code cell; `raises` marks a cell that shows an error on purpose (nbclient allows it)."""
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    tags = (["raises-exception"] if raises else []) + (["hide-input"] if hide else [])
    if tags:
        cell.metadata["tags"] = tags
    return cell


def write(path: str, cells: list[nbformat.NotebookNode]) -> None:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    nbformat.write(nb, path)
