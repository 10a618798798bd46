"""The docs stay true: the benchmarks page is what its renderer makes of the JSON, the guides' example outputs are
what their commands print, links resolve."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks", REPO / "scripts" / "render_benchmarks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    render = _renderer()
    return {render.slug(h) for h in re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M)}


def test_benchmarks_page_is_rendered_from_the_json():
    render = _renderer()
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert page == render.render_benchmarks(), "docs/benchmarks.md is out of date: run `make docs`"
    readme = (REPO / "README.md").read_text()
    assert readme == render.render_readme(readme), "README.md's results table is out of date: run `make docs`"


def test_check_mode_agrees(capsys):
    assert _renderer().main(["--check"]) == 0, capsys.readouterr().err


def test_every_result_has_a_section():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for result in sorted((REPO / "bench" / "results").glob("*.json")):
        assert f"(../bench/results/{result.name})" in page, f"no section for {result.name} in docs/benchmarks.md"
        assert f"(../bench/{result.stem}.py)" in page


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail to docs/"


def test_relative_links_resolve():
    broken = []
    for md in DOCS:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{md.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_fits_table_is_what_fits_table_computes():
    from helpers.placement.fits import fits_table

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("<!-- fits:start", 1)[1].split("-->", 1)[1].split("<!-- fits:end -->", 1)[0]
    computed = fits_table().markdown().strip()
    assert table.strip() == computed, "README's GPU table is stale: paste fits_table().markdown()"
    guide = (REPO / "docs" / "guides" / "05_multi_gpu.md").read_text(encoding="utf-8")
    assert computed in guide, "guide 05's table is stale: paste fits_table().markdown()"


def _guides_renderer():
    spec = importlib.util.spec_from_file_location("render_guides", REPO / "scripts" / "render_guides.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_guide_example_outputs_are_what_their_commands_print():
    render = _guides_renderer()
    marked = {md: md.read_text(encoding="utf-8") for md in render.docs() if render.MARKER in md.read_text()}
    assert REPO / "docs" / "guides" / "00_preflight.md" in marked
    for (md, text), rendered in zip(marked.items(), render.render_all(list(marked.values()))):
        assert rendered == text, (
            f"{md.relative_to(REPO)}: an example output differs from what its command prints now: run "
            "`python scripts/render_guides.py` (or `make docs`) and review the diff"
        )


def test_a_rendered_block_keeps_its_command_and_replaces_the_output():
    render = _guides_renderer()
    doc = f'Text.\n\n{render.MARKER}\n```text\n$ python -c "print(6 * 7)"\nstale\n```\n\n{render.MARKER}\n```\n>>> x = 6\n>>> print(x * 7)\n```\n'
    rendered = render.render(doc)
    assert rendered == doc.replace("stale\n", "42\n").replace("print(x * 7)\n", "print(x * 7)\n42\n")
    assert render.render(rendered) == rendered
