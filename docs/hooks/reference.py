"""mkdocs hook: the generated reference pages, and the benchmarks' charts, added at build time.

* ``on_files``: the pages of ``reference_pages.generate()`` (settings, proxy configuration, CLI,
  metrics: read out of the code at every build, so they cannot drift), and ``benchmarks/*.svg``
  (the charts the benchmark scripts write) as ``benchmarks/img/NAME.svg``.
* ``on_page_markdown``: a page under ``docs/benchmarks/`` links a chart as
  ``../../benchmarks/NAME.svg``, which works on GitHub; in the site that becomes ``img/NAME.svg``.

Nothing here fetches anything: the build works offline.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

sys.path.insert(0, str(Path(__file__).parent))

import reference_pages

_CHART_LINK = re.compile(r"\]\(\.\./\.\./benchmarks/([\w.-]+\.svg)\)")


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    for src_uri, text in reference_pages.generate().items():
        files.append(File.generated(config, src_uri, content=text))
    charts = Path(config.config_file_path).parent / "benchmarks"
    for svg in sorted(charts.glob("*.svg")):
        files.append(File.generated(config, f"benchmarks/img/{svg.name}", abs_src_path=str(svg)))
    return files


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    if page.file.src_uri.startswith("benchmarks/"):
        return _CHART_LINK.sub(r"](img/\1)", markdown)
    return markdown
