"""The ``fewbit`` command's entry point, kept outside the package: importing fewbit
imports torch, which takes seconds, and a Ctrl-C in those seconds must end the command
as one later does (``fewbit: interrupted``, status 130), not with an import traceback."""

import sys


def main() -> int:
    try:
        from fewbit.cli import main as run
    except KeyboardInterrupt:
        print("fewbit: interrupted", file=sys.stderr)
        return 130
    return run()
