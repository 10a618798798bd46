"""Fill the guides' example outputs by running them, so a sample never drifts from what the tool prints.

A fenced block right after the marker line ``<!-- output: scripts/render_guides.py -->`` is rendered:
its command lines are kept and everything after them is replaced by what they print. A block whose
first line starts with ``$ `` runs that shell command (``python`` is this interpreter); a block of
``>>> `` lines runs them as one Python program. Both run offline (HF_HUB_OFFLINE=1: the shipped
configs) and without a GPU (CUDA_VISIBLE_DEVICES=""), so the output is the same on every machine.

Usage:
    python scripts/render_guides.py          # rewrite the stale blocks in README.md and docs/**/*.md
    python scripts/render_guides.py --check  # exit 1 when a block differs from what its command prints
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- output: scripts/render_guides.py -->"
# The marker, the opening fence, the body, the closing fence (same fence characters as the opening)
BLOCK = re.compile(
    r"^(?P<head>" + re.escape(MARKER) + r"\n(?P<fence>```+)[^\n]*\n)(?P<body>.*?\n)(?P=fence)[ \t]*$", re.M | re.S
)


def docs() -> list[Path]:
    """The Markdown files that may hold rendered blocks."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _env() -> dict[str, str]:
    """Offline (the shipped configs answer), no GPU (judged against a T4), this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}


def _run(argv: list[str]) -> str:
    """What ``argv`` prints on stdout (library warnings on stderr stay out of the docs); a command that
    fails is an error naming it."""
    done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    # `helpers estimate` exits 1 for "does not fit" (its verdict, shown on purpose in a guide), 2 for an error
    verdict = argv[1:4] == ["-m", "helpers", "estimate"] and done.returncode == 1
    if done.returncode != 0 and not verdict:
        raise RuntimeError(f"`{shlex.join(argv)}` exited {done.returncode}:\n{done.stderr.strip()}")
    return done.stdout


def commands(body: str) -> list[str]:
    """The block's command lines: one ``$ `` line, or the leading ``>>> `` lines."""
    lines = body.splitlines()
    if lines and lines[0].startswith("$ "):
        return lines[:1]
    prompts = list(takewhile(lambda ln: ln.startswith(">>> "), lines))
    if not prompts:
        raise ValueError(f"a rendered block starts with a `$ ` command or `>>> ` lines, not {lines[:1]}")
    return prompts


def output(cmds: list[str]) -> str:
    """What the block's commands print."""
    if cmds[0].startswith("$ "):
        argv = shlex.split(cmds[0][2:])
        return _run([sys.executable if argv[0] == "python" else argv[0], *argv[1:]])
    return _run([sys.executable, "-c", "\n".join(c[4:] for c in cmds)])


def render(text: str) -> str:
    """``text`` with every marked block's output replaced by what its commands print now."""

    def fill(m: re.Match) -> str:
        cmds = commands(m["body"])
        out = output(cmds).rstrip("\n")
        return f"{m['head']}{chr(10).join(cmds)}\n{out}\n{m['fence']}"

    rendered, n = BLOCK.subn(fill, text)
    if n != text.count(MARKER):
        raise ValueError(f"{text.count(MARKER) - n} of the {MARKER} lines is not followed by a fenced block")
    return rendered


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a rendered block is stale")
    args = ap.parse_args(argv)
    stale = {}
    for md in docs():
        text = md.read_text(encoding="utf-8")
        if MARKER in text and (new := render(text)) != text:
            stale[md] = new
    names = ", ".join(str(p.relative_to(REPO)) for p in stale)
    if args.check:
        if stale:
            print(f"{names}: example output differs from what the command prints: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    for md, new in stale.items():
        md.write_text(new, encoding="utf-8")
        print(f"wrote {md.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
