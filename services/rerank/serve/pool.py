"""The checkpoints one rerank process serves: its default model (``--checkpoint``) and,
with ``--checkpoint-dir DIR``, every checkpoint under DIR by its directory name, loaded on
first use and kept in a small LRU (``--max-loaded``, the default model not counted), so
the generations of a rollout and its rollback can each name their own reranker
(docs/rerank.md "Several checkpoints").

A name is checked before any path is built from it
(:func:`services.common.retrieval_setting.check_checkpoint_name`: one directory name, no
separators, no ``..``) and the resolved directory must still be inside DIR (a symlink out
of it is refused); a name with no checkpoint there is NotFound. Loads run one at a time
under the pool's lock (a second request for the same name waits for the first load, not
a second one; a request for another named checkpoint waits too, the default model's
never); a
scorer evicted while a request still uses it is freed by that request's end (no explicit
close: it is a torch module). No grpc here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound
from services.common.retrieval_setting import check_checkpoint_name
from services.rerank.checkpoint import CONFIG_FILE
from services.rerank.serve.scorer import CeliScorer

Loader = Callable[[Path, str], CeliScorer]  # (checkpoint directory, name) -> scorer


class ScorerPool:
    """The default scorer and the named ones (see the module's docstring)."""

    def __init__(
        self,
        default: CeliScorer,
        checkpoint_dir: Path | None = None,
        load: Loader | None = None,
        max_loaded: int = 2,
    ) -> None:
        if max_loaded < 1:
            raise InvalidArgument("max_loaded must be >= 1")
        if checkpoint_dir is not None and load is None:
            raise InvalidArgument("a checkpoint directory needs a loader")
        self.default = default
        self.root = None if checkpoint_dir is None else Path(checkpoint_dir).resolve()
        self._load = load
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, CeliScorer] = OrderedDict()
        self._lock = threading.Lock()  # the LRU and the loads (one at a time)

    def loaded(self) -> list[str]:
        """The named checkpoints in memory now, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def path_of(self, name: str) -> Path:
        """The directory of checkpoint ``name``: InvalidArgument for a name that is not
        one, NotFound when this process serves no such checkpoint."""
        check_checkpoint_name(name)
        if self.root is None:
            raise NotFound(
                f"rerank checkpoint {name!r}: this rerank service serves only its default "
                "model (started without --checkpoint-dir)"
            )
        path = (self.root / name).resolve()
        if path.parent != self.root or not (path / CONFIG_FILE).is_file():
            raise NotFound(
                f"rerank checkpoint {name!r}: no checkpoint {name}/ ({CONFIG_FILE}) under "
                f"{self.root}"
            )
        return path

    def get(self, name: str) -> CeliScorer:
        """The scorer of checkpoint ``name`` ("" = the default model), loaded when it is
        not in memory (blocking: call it from a worker thread)."""
        if not name:
            return self.default
        with self._lock:
            scorer = self._loaded.get(name)
            if scorer is not None:
                self._loaded.move_to_end(name)
                return scorer
            path = self.path_of(name)
            assert self._load is not None  # a root comes with a loader (__init__)
            scorer = self._load(path, name)
            self._loaded[name] = scorer
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)
            return scorer
