"""What under a folder another local user could read: the check the at-rest tests share
(issue #33 point 3, ``test_stack_at_rest``, ``test_stack_generations``)."""

from __future__ import annotations

import stat
from pathlib import Path


def not_private(root: Path) -> list[str]:
    """Each path under ``root`` (``root`` included) that is neither a 0700 directory nor
    a 0600 file (or 0700: a program its owner runs), as ``"relative/path: 0o755"``.
    Symlinks are skipped, and so is a path gone meanwhile (a temp file renamed)."""
    wrong = []
    for path in (root, *root.rglob("*")):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        allowed = (0o700,) if stat.S_ISDIR(st.st_mode) else (0o600, 0o700)
        if mode not in allowed:
            wrong.append(f"{path.relative_to(root)}: {oct(mode)}")  # root itself: "."
    return wrong
