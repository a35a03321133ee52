"""``gtr-retrieval corpus ...``: corpora that come with the system."""

from __future__ import annotations

import argparse
from typing import Any

from services.cli.common import add_group


def add_cli(sub: Any) -> None:
    csub = add_group(sub, "corpus", metavar="CORPUS", help="Corpora that ship with the system.")
    stdlib = csub.add_parser(
        "stdlib",
        help="Write the Python standard library documentation as a JSONL corpus.",
        description="One document per public module, class, function and method with a "
        "docstring; the title is its qualified name (csv.reader).",
    )
    stdlib.add_argument("--out", required=True, help="Output JSONL file.")
    stdlib.add_argument("--limit", type=int, default=None, help="At most this many documents.")
    stdlib.set_defaults(handler=_stdlib)


def _stdlib(args: argparse.Namespace) -> int:
    from services.corpus.stdlib import collect_in_subprocess, write_jsonl

    docs = collect_in_subprocess(limit=args.limit)
    write_jsonl(docs, args.out)
    print(f"wrote {len(docs)} documents to {args.out}")
    return 0
