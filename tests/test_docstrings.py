"""The public API's docstrings say what a call does, where it runs (the kernel or the ranks)
and show an example: the course site's API reference (docs/api.md) is made from them."""

from __future__ import annotations

import inspect

import pytest

import labkit
from labkit.kernel.magics import LabMagics

PUBLIC = [name for name in labkit.__all__ if name != "__version__"]
LAB_METHODS = ["run", "run_script", "pull", "push", "trace", "stacks", "debug", "restart",
               "stop", "attach"]  # fmt: skip


def _documented() -> list[tuple[str, object]]:
    items = [(f"labkit.{name}", getattr(labkit, name)) for name in PUBLIC]
    items += [(f"labkit.Lab.{name}", getattr(labkit.Lab, name)) for name in LAB_METHODS]
    items += [("%lab", LabMagics.lab), ("%%ranks", LabMagics.ranks)]
    return items


@pytest.mark.parametrize("name, obj", _documented(), ids=[n for n, _ in _documented()])
def test_public_docstring_says_where_and_shows_an_example(name, obj) -> None:
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    assert "xample" in doc, f"{name}'s docstring shows no example (write 'Example: ...')"
    assert "kernel" in doc.lower() or "rank" in doc.lower(), (
        f"{name}'s docstring does not say where it runs (the kernel, or the ranks)"
    )


def test_the_api_page_documents_every_public_name() -> None:
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs/api.md")) as f:
        page = f.read()
    missing = [n for n in PUBLIC if f"labkit.{n}\n" not in page and f"labkit.{n}\r" not in page]
    assert not missing, f"the reference in docs/api.md leaves out: {missing}"
