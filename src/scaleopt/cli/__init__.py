"""The ``scaleopt`` command: ``train``, ``study large-batch``, ``bench`` and ``info``, each in
its own module with its parser (``add_parser``) and the function that runs it (``command``).

Exit codes: 0 success; 2 bad arguments or values (with a message naming the option);
3 the training diverged (the loss became inf or NaN); 130 interrupted by Ctrl-C or SIGTERM (the
run stops after its current step and writes its results so far); 1 any other failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .. import __version__
from . import bench, info, study, train
from .launch import WorkersLost
from .options import EXIT_DIVERGED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from .trainer import Diverged


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="scaleopt",
        description="Train, compare and benchmark the scaleopt optimizers on built-in data "
                    "(generated, nothing is downloaded).",
        epilog="Exit codes: 0 success, 2 bad arguments, 3 training diverged, 130 interrupted "
               "(Ctrl-C or SIGTERM: the results so far are written), 1 other failure.")
    ap.add_argument("--version", action="version", version=f"scaleopt {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in (train, study, bench, info):
        command.add_parser(sub)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))  # 2 on a usage error
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"scaleopt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Diverged as exc:
        print(f"scaleopt {args.command}: training diverged: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except WorkersLost as exc:
        print(f"scaleopt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # a second Ctrl-C
        print(f"scaleopt {args.command}: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED


def console() -> None:
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the output's reader left (``scaleopt train | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    sys.exit(code)
