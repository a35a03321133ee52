"""Files for their owner only: what holds documents, vectors, models or secrets.

The local stack runs under ``PRIVATE_UMASK`` (services/stack/launcher.py), so what it
makes is its owner's alone; what other commands add to its run directory under their
user's umask (a rollout's trained index, a published encoder version) is tightened with
:func:`make_private`, and :func:`is_private` says whether a folder is kept so.
"""

from __future__ import annotations

import stat
from pathlib import Path

# no group or other bits on anything made in a private directory
PRIVATE_UMASK = 0o077


def is_private(path: Path) -> bool:
    """Whether ``path`` grants nothing to its group or to others."""
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def make_private(root: Path) -> None:
    """``root`` and everything under it for its owner only: directories 0700, files their
    owner bits alone (0600, or 0700 for an executable). A run directory made by an older
    ``up`` (0755 directories, 0644 files) is tightened on the next start."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in (root, *root.rglob("*")):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue  # removed meanwhile (a pruned snapshot of a previous run)
        if stat.S_ISLNK(st.st_mode):
            continue  # a link's own mode means nothing; its target is walked if inside
        private = 0o700 if stat.S_ISDIR(st.st_mode) else st.st_mode & 0o700
        if stat.S_IMODE(st.st_mode) != private:
            path.chmod(private)
