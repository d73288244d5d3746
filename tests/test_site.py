"""The built docs site stands alone: no page loads a script, a stylesheet, a font or an image
from off the site (formulas render with no network), and its pages have what the theme
promises (per-page contents, copy buttons, the footer).

It reads ``docs/_build`` where ``.ci/run`` built it, else builds the site into a temporary
folder; it needs the ``docs`` extra (Sphinx and the theme), which ``.ci/run`` installs."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

#: builds the Sphinx site: the slow run (pytest -m slow)
pytestmark = pytest.mark.slow

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"

#: what a browser fetches by itself as it shows a page (links the reader may follow are not)
_LOADED = re.compile(
    r"<(?:script|img|iframe|source|embed)\b[^>]*\bsrc=\"([^\"]+)\""
    r"|<link\b[^>]*\bhref=\"([^\"]+)\"[^>]*>", re.I)
_CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)")
_MATHJAX_FONTS = re.compile(r"fontURL:[^,}]*?\"([^\"]+)\"")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("sphinx", reason="needs the docs extra (pip install -e '.[docs]')")
    pytest.importorskip("furo", reason="needs the docs extra (pip install -e '.[docs]')")
    built = DOCS / "_build"
    if (built / "index.html").is_file():
        return built
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-W", "-b", "html", str(DOCS),
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out


def _off_site(url: str) -> bool:
    return bool(re.match(r"^(https?:)?//", url.strip()))


def test_no_page_loads_anything_from_off_the_site(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 15
    for page in pages:
        for m in _LOADED.finditer(page.read_text(errors="replace")):
            tag, url = m.group(0), m.group(1) or m.group(2)
            if tag.lower().startswith("<link") and not re.search(
                    r"rel=\"(stylesheet|preload|icon|shortcut icon|manifest)\"", tag):
                continue  # a link to another page, not something loaded
            assert not _off_site(url), f"{page.name} loads {url}"
    for css in site.rglob("*.css"):
        for url in _CSS_URL.findall(css.read_text(errors="replace")):
            assert not _off_site(url), f"{css.name} loads {url}"


def test_formulas_render_with_the_sites_own_mathjax(site):
    page = (site / "lamb.html").read_text()
    scripts = re.findall(r"<script\b[^>]*\bsrc=\"([^\"]*mathjax[^\"]*)\"", page, re.I)
    assert scripts and not any(_off_site(s) for s in scripts)
    local = site / pathlib.Path(scripts[0].split("?")[0])
    assert local.is_file() and local.stat().st_size > 100_000
    fonts = site / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert any(fonts.glob("*.woff")), "the formulas' fonts are not on the site"
    assert page.count('class="math') >= 3  # the formulas are marked up for MathJax


def test_pages_have_contents_copy_buttons_and_a_footer(site):
    page = (site / "lamb.html").read_text()
    assert "copybutton" in page  # the copy button's script
    assert 'class="toc-tree"' in page or "toc-drawer" in page  # "on this page"
    assert "the scaleopt authors" in page and "Apache-2.0" in page


def _png_size(path) -> tuple:
    head = pathlib.Path(path).read_bytes()[:24]
    assert head.startswith(b"\x89PNG\r\n\x1a\n")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_the_benchmarks_page_shows_one_bench_run_its_plot_and_its_table(site, tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (the cli or test extra)")
    from scaleopt.cli.report import write_bench_plot

    page = (site / "benchmarks.html").read_text()
    shown = re.findall(r"<img\b[^>]*\bsrc=\"([^\"]*cpu-small\.png)\"", page)
    assert shown and (site / shown[0]).is_file()
    result = json.loads((DOCS / "bench" / "cpu-small.json").read_text())
    # the plot is the one `scaleopt bench` draws from the run's bench.json
    assert _png_size(site / shown[0]) == _png_size(
        write_bench_plot(result, str(tmp_path / "bench.png")))
    # and the table gives that run's numbers, row by row
    table = (DOCS / "benchmarks.md").read_text()
    for row in result["rows"]:
        cells = (f"| {row['median_s'] * 1e3:.1f} ms | {row['ratio']:.2f} | "
                 f"{row['state_bytes_per_param']:.0f} |")
        assert cells in table, row["optimizer"]
