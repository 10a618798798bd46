"""``python -m helpers COMMAND ...``: the oomkit command line.

Each command lives in its own module as ``main(argv) -> int``; modules load only when used.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "preflight": ("helpers.preflight", "check GPU, RAM, disk and versions before loading a model"),
    "estimate": ("helpers.estimate", "estimate the memory a model needs and whether it fits"),
    "explain": ("helpers.oom", "explain an out-of-memory message (stdin or a file)"),
}


def usage() -> str:
    lines = ["usage: python -m helpers COMMAND [options]", "", "commands:"]
    lines += [f"  {name:10s} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "python -m helpers COMMAND --help for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ImportError as e:
        print(f"command {name!r} is not available in this version of oomkit ({e})", file=sys.stderr)
        return 2
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
