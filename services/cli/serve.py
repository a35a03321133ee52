"""``gtr-retrieval <service> serve``: one way for every service to declare its command.

Every flag after ``serve`` goes to the service's settings class (which prints its own
``--help``), so the parser only names the command and where its ``main`` lives; the
module is imported when the command runs (the CLI stays quick to start).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any


def add_serve(actions: Any, *, help: str, description: str, main: str) -> None:
    """Add ``serve`` to a service's ``actions``; ``main`` is ``"package.module:function"``,
    a ``function(argv) -> exit code``."""
    serve = actions.add_parser("serve", help=help, description=description, add_help=False)
    serve.set_defaults(handler=lambda args: _run(main, args), passthrough=True)


def _run(main: str, args: argparse.Namespace) -> int:
    module, _, function = main.partition(":")
    return int(getattr(importlib.import_module(module), function)(args.settings))
