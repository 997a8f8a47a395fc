"""The book builds strictly, and no page needs the network to render.

The site is built once (`mkdocs build --strict`, the command CI runs) and every page is
read: no script, stylesheet, font, image or frame may come from another host, every
local one must exist in the site, and a page with formulas or diagrams must load KaTeX
or mermaid from the site itself (Material for MkDocs would otherwise fetch mermaid
from a CDN from inside its own script, where no page source shows it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

pytestmark = pytest.mark.book

REPO_ROOT = Path(__file__).resolve().parents[2]
# Tags and attributes that make the browser fetch something to render the page.
_FETCHED = {"script": ("src",), "img": ("src", "srcset"), "source": ("src", "srcset"),
            "iframe": ("src",), "embed": ("src",), "object": ("data",), "video": ("src",),
            "audio": ("src",), "track": ("src",), "input": ("src",)}
_NOT_FETCHED_LINKS = {"canonical", "alternate", "prev", "next", "author", "license", "me",
                      "search"}


class _Resources(HTMLParser):
    """Collects (tag, url) of everything a page fetches, and its script order."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str]] = []
        self.scripts: list[str] = []
        self.inline_styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "link" and not set(a.get("rel", "").split()) & _NOT_FETCHED_LINKS:
            self.urls.append((tag, a.get("href", "")))
        for attr in _FETCHED.get(tag, ()):
            if a.get(attr):
                for part in a[attr].split(",") if attr == "srcset" else [a[attr]]:
                    self.urls.append((tag, part.strip().split(" ")[0]))
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"])
        if "style" in a:
            self.inline_styles.append(a["style"])
        self._in_style = tag == "style"

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.inline_styles.append(data)

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False


def _is_external(url: str) -> bool:
    return bool(urlsplit(url).scheme in ("http", "https") or url.startswith("//"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the book needs `pip install -e .[docs]`")
    if shutil.which("npm") is None:
        pytest.skip("the book takes KaTeX and mermaid from the npm registry: npm is needed")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _pages(site: Path) -> list[Path]:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 10
    return pages


def test_no_page_fetches_from_another_host(site: Path) -> None:
    offenders = []
    for page in _pages(site):
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        offenders += [(page.relative_to(site), tag, url) for tag, url in parser.urls
                      if _is_external(url)]
        offenders += [(page.relative_to(site), "style", u) for style in parser.inline_styles
                      for u in re.findall(r"url\(\s*['\"]?([^'\")]+)", style) if _is_external(u)]
    assert not offenders, offenders[:10]


def test_every_local_resource_exists(site: Path) -> None:
    missing = []
    for page in _pages(site):
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        base = page.relative_to(site).as_posix()
        for tag, url in parser.urls:
            if _is_external(url) or url.startswith(("data:", "#")) or not url:
                continue
            target = site / urlsplit(urljoin(base, url)).path.lstrip("/")
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                missing.append((base, tag, url))
    assert not missing, missing[:10]


def test_stylesheets_fetch_nothing_from_another_host(site: Path) -> None:
    offenders = []
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8", errors="replace")
        for url in re.findall(r"url\(\s*['\"]?([^'\")]+)", text):
            if _is_external(url):
                offenders.append((css.relative_to(site), url))
        offenders += [(css.relative_to(site), m) for m in re.findall(
            r"@import\s+(?:url\()?['\"]?(https?:[^'\")\s]+)", text)]
    assert not offenders, offenders[:10]


def test_math_and_diagrams_come_from_the_site(site: Path) -> None:
    math_pages = diagram_pages = 0
    for page in _pages(site):
        html = page.read_text(encoding="utf-8")
        parser = _Resources()
        parser.feed(html)
        local = [src for src in parser.scripts if not _is_external(src)]
        styles = [url for tag, url in parser.urls if tag == "link"]
        if 'class="arithmatex"' in html:
            math_pages += 1
            assert any(s.endswith("vendor/katex/katex.min.js") for s in local), page
            assert any(s.endswith("vendor/katex/contrib/auto-render.min.js") for s in local)
            assert any(s.endswith("vendor/katex-init.js") for s in local), page
            assert any(u.endswith("vendor/katex/katex.min.css") for u in styles), page
        if 'class="mermaid"' in html:
            diagram_pages += 1
            mermaid = [i for i, s in enumerate(local) if s.endswith("vendor/mermaid/mermaid.min.js")]
            bundle = [i for i, s in enumerate(local) if "javascripts/bundle." in s]
            # Defined before Material's bundle runs, which then never fetches its own.
            assert mermaid and bundle and mermaid[0] < bundle[0], page
    assert math_pages >= 2 and diagram_pages >= 1
    fonts = site / "assets" / "vendor" / "katex" / "fonts"
    css = (site / "assets" / "vendor" / "katex" / "katex.min.css").read_text()
    for woff2 in set(re.findall(r"fonts/(KaTeX_[\w-]+\.woff2)", css)):
        assert (fonts / woff2).is_file(), woff2
    for package in ("katex", "mermaid"):
        assert (site / "assets" / "vendor" / package / "LICENSE").is_file()
