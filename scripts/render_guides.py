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
import json
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


# One interpreter runs every block (importing torch and helpers once, not once per block): each block's
# stdout is captured on its own, a `$ python -m MOD` command runs as that module's __main__, any other
# `$ ` command in its own process. It reads the blocks as JSON on stdin and answers JSON on stdout.
_DRIVER = r"""
import contextlib, io, json, runpy, shlex, subprocess, sys

def run(cmds):
    if cmds[0].startswith("$ "):
        argv = shlex.split(cmds[0][2:])
        if argv[:2] != ["python", "-m"]:
            argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
            done = subprocess.run(argv, capture_output=True, text=True)
            return done.stdout, done.returncode, done.stderr
        sys.argv = argv[2:]
        try:
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            return None, code, ""
        return None, 0, ""
    exec(compile("\n".join(c[4:] for c in cmds), "<guide>", "exec"), {"__name__": "__main__"})
    return None, 0, ""

results = []
for cmds in json.load(sys.stdin):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            out, code, err = run(cmds)
    except Exception as exc:
        out, code, err = None, 1, f"{type(exc).__name__}: {exc}"
    results.append({"out": buf.getvalue() if out is None else out, "code": code, "err": err})
sys.__stdout__.write(json.dumps(results))
"""


def _failed(cmds: list[str], code: int) -> bool:
    """Whether a block's exit status is a failure; `helpers estimate` exits 1 for "does not fit" (its
    verdict, shown on purpose in a guide) and 2 for an error."""
    verdict = shlex.split(cmds[0][2:])[1:4] == ["-m", "helpers", "estimate"] if cmds[0].startswith("$ ") else False
    return code != 0 and not (verdict and code == 1)


def outputs(blocks: list[list[str]]) -> list[str]:
    """What each block's commands print (stdout; library warnings on stderr stay out of the docs), all run
    in one interpreter; a block that fails is an error naming its commands."""
    if not blocks:
        return []
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(blocks),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rendering the guides' examples failed:\n{done.stderr.strip()}")
    results = json.loads(done.stdout)
    for cmds, res in zip(blocks, results):
        if _failed(cmds, res["code"]):
            shown = "\n".join(cmds)
            raise RuntimeError(f"`{shown}` exited {res['code']}:\n{(res['err'] or done.stderr).strip()}")
    return [res["out"] for res in results]


def commands(body: str) -> list[str]:
    """The block's command lines: one ``$ `` line, or the leading ``>>> `` lines."""
    lines = body.splitlines()
    if lines and lines[0].startswith("$ "):
        return lines[:1]
    prompts = list(takewhile(lambda ln: ln.startswith(">>> "), lines))
    if not prompts:
        raise ValueError(f"a rendered block starts with a `$ ` command or `>>> ` lines, not {lines[:1]}")
    return prompts


def render_all(texts: list[str]) -> list[str]:
    """Each of ``texts`` with every marked block's output replaced by what its commands print now."""
    found = []
    for text in texts:
        matches = list(BLOCK.finditer(text))
        if len(matches) != text.count(MARKER):
            raise ValueError(
                f"{text.count(MARKER) - len(matches)} of the {MARKER} lines is not followed by a fenced block"
            )
        found.append(matches)
    outs = iter(outputs([commands(m["body"]) for matches in found for m in matches]))
    rendered = []
    for text, matches in zip(texts, found):
        pieces, at = [], 0
        for m in matches:
            cmds = commands(m["body"])
            out = next(outs).rstrip("\n")
            pieces += [text[at : m.start()], f"{m['head']}{chr(10).join(cmds)}\n{out}\n{m['fence']}"]
            at = m.end()
        rendered.append("".join(pieces) + text[at:])
    return rendered


def render(text: str) -> str:
    """``text`` with every marked block's output replaced by what its commands print now."""
    return render_all([text])[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a rendered block is stale")
    args = ap.parse_args(argv)
    texts = {md: md.read_text(encoding="utf-8") for md in docs()}
    texts = {md: text for md, text in texts.items() if MARKER in text}
    stale = {md: new for (md, text), new in zip(texts.items(), render_all(list(texts.values()))) if new != text}
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
