"""oomkit's tables in a narrow notebook column, rendered by Chromium with JupyterLab's own output-area CSS
(opt-in: ``make test-browser``; a few seconds, no server).

Colab's column with its Files pane open at a 760 px window is about 330 px wide (the full browser test measured
328 px in JupyterLab 3.6): an output wider than its column scrolls sideways and hides its last columns. Each
table is rendered at 328 and 300 px inside JupyterLab's output-area markup, with the stylesheet nbconvert's lab
template ships (the rules JupyterLab applies to an HTML output: its table cells' padding, right alignment,
``table-layout``), from JupyterLab 4 and, where ``$OOMKIT_LAB3_PYTHON`` names one, from JupyterLab 3.6 (Colab's
ipywidgets 7.7 run). Container width, not viewport: nothing here may depend on the window's width.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from browser_lab import chromium_page, missing_requirements

pytestmark = pytest.mark.browser

WIDTHS = (328, 300)  # Colab's column with the Files pane open, and a little less


def lab_css_folders() -> dict[str, Path]:
    """nbconvert's lab template stylesheets of each JupyterLab the browser test runs."""
    found = {}
    prefixes = {"lab4": Path(sys.prefix)}
    lab3 = os.environ.get("OOMKIT_LAB3_PYTHON")
    if lab3:
        prefixes["lab3"] = Path(lab3).parents[1]
    for name, prefix in prefixes.items():
        folder = prefix / "share" / "jupyter" / "nbconvert" / "templates" / "lab" / "static"
        if (folder / "index.css").exists():
            found[name] = folder
    return found


def outputs() -> dict[str, str]:
    """What notebooks 00-02 and preflight show, as HTML."""
    from helpers import estimate, fits_table, preflight

    model = "codellama/CodeLlama-7b-hf"
    return {
        "fits_table(model)": fits_table(model, tokens=768)._repr_html_(),
        "fits_table()": fits_table()._repr_html_(),
        "estimate": estimate(model, load="nf4", device="t4")._repr_html_(),
        "preflight": preflight(model, show=False)._repr_html_(),
    }


# JupyterLab's markup around an HTML output: the prompt beside it is outside the width given
PAGE = """<html><head><link rel=stylesheet href='{css}/index.css'><link rel=stylesheet href='{css}/theme-light.css'>
</head><body class='jp-Notebook'><div class='jp-OutputArea'><div class='jp-OutputArea-child' style='width:{width}px'>
<div class='jp-OutputArea-output jp-RenderedHTMLCommon jp-RenderedHTML' data-mime-type='text/html'>{html}</div>
</div></div></body></html>"""

_JS_WIDE = """() => {
  const out = document.querySelector('.jp-OutputArea-output'), edge = out.getBoundingClientRect().right;
  const past = [...out.querySelectorAll('*')].filter(e => e.getBoundingClientRect().right > edge + 1);
  return {scroll: out.scrollWidth, client: out.clientWidth,
          past: past.slice(-2).map(e => `${e.tagName} ${e.innerText.slice(0, 40)}`)};
}"""


def test_every_table_fits_a_narrow_column(tmp_path):
    missing = missing_requirements()
    if missing:
        pytest.fail("browser test needs: " + "; ".join(missing) + " (make test-browser installs them)")
    folders = lab_css_folders()
    assert "lab4" in folders, "JupyterLab's nbconvert lab template is missing (pip install -r requirements-browser.txt)"
    shown, wide = outputs(), []
    with chromium_page(viewport=(900, 900)) as page:
        for lab, css in folders.items():
            for width in WIDTHS:
                for what, html in shown.items():
                    f = tmp_path / "page.html"
                    f.write_text(PAGE.format(css=css.as_uri(), width=width, html=html))
                    page.goto(f.as_uri())
                    got = page.evaluate(_JS_WIDE)
                    assert got["client"] == width  # the markup gave the output the column's width
                    if got["scroll"] > got["client"] + 1:
                        wide.append(f"{lab} {width} px: {what} is {got['scroll']} px wide ({got['past']})")
    assert not wide, "\n".join(wide)
