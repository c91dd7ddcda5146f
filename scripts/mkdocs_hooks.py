"""MkDocs hook: the site's home page is README.md, so the README stays the one front page.

The README links to ``docs/<page>.md`` (right on GitHub); on the site those pages sit beside
the home page, so the prefix is dropped. mkdocs.yml names this file under ``hooks``.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return re.sub(r"\]\(docs/", "](", README.read_text())
