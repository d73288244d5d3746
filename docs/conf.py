"""Sphinx configuration: Markdown pages (MyST) and the API reference from the docstrings."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

project = "scaleopt"
author = "the scaleopt authors"
copyright = "2026, the scaleopt authors (Apache-2.0)"
# MathJax from the package sphinx-mathjax-offline, copied into the site: the formulas render
# with no network access (the built site references no external script or font)
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax",
              "sphinx-mathjax-offline", "sphinx_copybutton"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "recipes"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
html_theme = "furo"  # wide content, per-page contents, tables and code that scroll in their box
html_title = "scaleopt"
html_static_path = ["_static"]
html_css_files = ["scaleopt.css"]
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True
