"""Plain-text copies of the views' static HTML (kernel side), for frontends without HTML.

Terminal IPython, a console, `nbconvert --to script`/`markdown` and anything that reads a
saved notebook's `text/plain` show a view as this text instead of the widget's repr
(`VBox(children=...)`). It is derived from the view's own `to_html()` (labkit's tables,
headings, paragraphs and warnings), so every view has one without writing it twice: a table
becomes aligned columns under its caption, a heading or paragraph a line of its own.
"""

from __future__ import annotations

from html.parser import HTMLParser

_BLOCKS = {"h1", "h2", "h3", "h4", "h5", "h6", "p", "div", "li", "caption", "br", "pre"}


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self.line: list[str] = []
        self.table: list[list[str]] | None = None
        self.cell: list[str] | None = None
        self.skip = 0  # inside <style> or <script>

    def _flush(self) -> None:
        text = " ".join("".join(self.line).split())
        if text:
            self.lines.append(text)
        self.line = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in ("style", "script"):
            self.skip += 1
        elif tag == "table":
            self._flush()
            self.table = []
        elif tag == "tr" and self.table is not None:
            self.table.append([])
        elif tag in ("td", "th") and self.table is not None:
            self.cell = []
        elif tag in _BLOCKS and self.cell is None:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in ("style", "script"):
            self.skip = max(0, self.skip - 1)
        elif tag in ("td", "th") and self.table is not None and self.cell is not None:
            if not self.table:
                self.table.append([])
            self.table[-1].append(" ".join("".join(self.cell).split()))
            self.cell = None
        elif tag == "caption":
            self._flush()
        elif tag == "table" and self.table is not None:
            self.lines.extend(columns([row for row in self.table if row]))
            self.table = None
        elif tag in _BLOCKS and self.cell is None:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        (self.cell if self.cell is not None else self.line).append(data)


def columns(rows: list[list[str]]) -> list[str]:
    """Rows as text lines, each column as wide as its widest cell."""
    if not rows:
        return []
    width = max(len(r) for r in rows)
    sizes = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(width)]
    return ["  ".join(c.ljust(sizes[i]) for i, c in enumerate(r)).rstrip() for r in rows]


def html_to_text(markup: str) -> str:
    """The text of labkit's static HTML: tables as aligned columns, one line per block."""
    parser = _Text()
    parser.feed(markup)
    parser.close()
    parser._flush()
    return "\n".join(parser.lines)
