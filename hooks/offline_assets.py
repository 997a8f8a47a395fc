"""A MkDocs hook: the book's math and diagrams render with no network.

Formulas (`pymdownx.arithmatex`) are typeset by KaTeX and diagrams (mermaid fences) are
drawn by mermaid, both in the reader's browser. Left alone, Material for MkDocs fetches
mermaid from a CDN and nothing typesets the math at all. This hook takes both libraries
from the npm registry with `npm pack` (pinned versions, checked by npm against the
registry's integrity hashes), keeps the few files the book needs in a cache directory,
publishes them under `assets/vendor/` with their licenses, and adds them only to the
pages that use them. Material uses a `mermaid` that a page already defines instead of
fetching its own.

Without npm the build warns (and so fails under `--strict`); the pages then show
formulas as LaTeX and fetch mermaid from its CDN.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.offline_assets")

# npm package -> (pinned version, files of its tarball to publish, relative to package/)
PACKAGES: dict[str, tuple[str, list[str]]] = {
    "katex": ("0.16.47", [
        "LICENSE", "dist/katex.min.css", "dist/katex.min.js", "dist/contrib/auto-render.min.js",
        *(f"dist/fonts/KaTeX_{face}.woff2" for face in (
            "AMS-Regular", "Caligraphic-Bold", "Caligraphic-Regular", "Fraktur-Bold",
            "Fraktur-Regular", "Main-Bold", "Main-BoldItalic", "Main-Italic", "Main-Regular",
            "Math-BoldItalic", "Math-Italic", "SansSerif-Bold", "SansSerif-Italic",
            "SansSerif-Regular", "Script-Regular", "Size1-Regular", "Size2-Regular",
            "Size3-Regular", "Size4-Regular", "Typewriter-Regular")),
    ]),
    # Material for MkDocs 9 expects mermaid 11.
    "mermaid": ("11.17.2", ["LICENSE", "dist/mermaid.min.js"]),
}
VENDOR = "assets/vendor"

# KaTeX typesets only what arithmatex marked: \( \) inline and \[ \] displayed.
# `document$` is Material's page-load observable (it also fires after instant loading).
KATEX_INIT = """\
document$.subscribe(function () {
  document.querySelectorAll(".arithmatex").forEach(function (element) {
    renderMathInElement(element, {
      delimiters: [
        {left: "\\\\(", right: "\\\\)", display: false},
        {left: "\\\\[", right: "\\\\]", display: true},
      ],
      throwOnError: false,
    });
  });
});
"""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mini-vllm" / "book-assets"


def fetch(name: str, version: str, members: list[str], root: Path) -> Path:
    """The directory holding `members` of npm package `name@version`, fetched once.

    Raises:
        RuntimeError: when npm is missing or fails, or the tarball lacks a member.
    """
    target = root / f"{name}-{version}"
    stamp = target / ".members.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == members:
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm (Node.js) is not installed")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        done = subprocess.run(
            [npm, "pack", f"{name}@{version}", "--pack-destination", tmp, "--silent"],
            capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"npm pack {name}@{version} failed: {done.stderr.strip()}")
        tarball = Path(tmp) / done.stdout.strip().splitlines()[-1]
        out = Path(tmp) / "out"
        with tarfile.open(tarball) as tar:
            for member in members:
                try:
                    source = tar.extractfile(f"package/{member}")
                except KeyError:
                    source = None
                if source is None:
                    raise RuntimeError(f"{name}@{version} has no {member}")
                dest = out / member
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(source.read())
        (out / ".members.json").write_text(json.dumps(members))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(out, target)
    return target


def _dest(name: str, member: str) -> str:
    return f"{VENDOR}/{name}/{member.removeprefix('dist/')}"


_fetched: dict[str, Path] = {}


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    _fetched.clear()
    for name, (version, members) in PACKAGES.items():
        try:
            _fetched[name] = fetch(name, version, members, cache_root())
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            log.warning("cannot vendor %s@%s for offline reading (%s): pages that use it "
                        "need the network", name, version, e)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for name, directory in _fetched.items():
        for member in PACKAGES[name][1]:
            files.append(File.generated(config, _dest(name, member),
                                        abs_src_path=str(directory / member)))
    if "katex" in _fetched:
        files.append(File.generated(config, f"{VENDOR}/katex-init.js", content=KATEX_INIT))
    return files


def on_post_page(output: str, page: Page, config: MkDocsConfig) -> str:
    def url(path: str) -> str:
        return get_relative_url(path, page.url)

    head, body = [], []
    if "katex" in _fetched and 'class="arithmatex"' in output:
        head.append(f'<link rel="stylesheet" href="{url(_dest("katex", "dist/katex.min.css"))}">')
        body += [f'<script src="{url(path)}"></script>' for path in (
            _dest("katex", "dist/katex.min.js"), _dest("katex", "dist/contrib/auto-render.min.js"),
            f"{VENDOR}/katex-init.js")]
    if "mermaid" in _fetched and 'class="mermaid"' in output:
        # Defined before Material's bundle runs, so that it never fetches its own.
        head.append(f'<script src="{url(_dest("mermaid", "dist/mermaid.min.js"))}"></script>')
    if head:
        output = output.replace("</head>", "\n".join(head) + "\n</head>", 1)
    if body:
        output = output.replace("</body>", "\n".join(body) + "\n</body>", 1)
    return output
