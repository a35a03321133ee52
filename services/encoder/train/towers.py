"""The five dual-encoder architectures of Dong et al. (2022), built from one checkpoint.

"Exploring Dual Encoder Architectures for Question Answering" compares the Siamese dual
encoder (SDE: one tower for queries and documents) with the asymmetric one (ADE: two
towers, both initialised from the same checkpoint) and three ways of sharing between
ADE's towers:

* ``ade-ste``: the token embedding table is one module in both towers (trained jointly);
* ``ade-fte``: the token embedding table is frozen (and, being frozen, shared);
* ``ade-spl``: the projection layer after pooling is one module in both towers. GTR
  checkpoints have one (``2_Dense``, d×d, no bias); a checkpoint without a Dense layer
  (all-MiniLM-L6-v2, the packaged default) gets a new d×d projection without bias,
  initialised to the identity, so the untrained SPL model is exactly the base model.

Each tower is a :class:`~services.encoder.model.DualEncoder`, the module the service
serves and exports, so a trained tower is saved as an ordinary sentence-transformers
checkpoint (:func:`save_tower`) that every other command loads unchanged.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from services.common.errors import InvalidArgument
from services.encoder.model import DualEncoder, load_dual_encoder, read_layout, tower_dirs

Arch = Literal["sde", "ade", "ade-ste", "ade-fte", "ade-spl"]
ARCHS: tuple[Arch, ...] = get_args(Arch)
__all__ = ["ARCHS", "Arch", "Towers", "build_towers", "save_towers", "tower_dirs"]
IDENTITY = "torch.nn.modules.linear.Identity"
DENSE_DIR = "2_Dense"


def check_arch(arch: str) -> Arch:
    if arch not in ARCHS:
        raise InvalidArgument(f"unknown arch {arch!r}: use one of {', '.join(ARCHS)}")
    return arch  # type: ignore[return-value]


def is_asymmetric(arch: Arch) -> bool:
    return arch != "sde"


@dataclass
class Towers:
    """The query tower and the document tower (the same module for SDE)."""

    arch: Arch
    query: DualEncoder
    document: DualEncoder
    added_projection: bool = False  # SPL on a checkpoint without a Dense layer

    def modules(self) -> list[DualEncoder]:
        return [self.query] if self.query is self.document else [self.query, self.document]

    def parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter once (shared modules are not counted twice)."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for p in module.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for tower, module in zip(("query", "document"), self.modules(), strict=False):
            for name, p in module.named_parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), (f"{tower}.{name}", p))
        return list(seen.values())

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"query": self.query.state_dict(), "document": self.document.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.query.load_state_dict(state["query"])
        if self.document is not self.query:
            self.document.load_state_dict(state["document"])
        self._tie()

    def train(self, mode: bool = True) -> None:
        for module in self.modules():
            module.train(mode)

    def _tie(self) -> None:
        """Re-point shared modules after a state load (loading copies into each tower)."""
        if self.arch in ("ade-ste", "ade-fte"):
            hf(self.document).set_input_embeddings(input_embeddings(self.query))
        if self.arch == "ade-spl":
            self.document.dense = self.query.dense


def identity_projection(dim: int) -> nn.Module:
    """A d×d linear layer without bias, initialised to the identity (the SPL default)."""
    linear = nn.Linear(dim, dim, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(dim))
    return nn.Sequential(linear, nn.Identity())


def hf(encoder: DualEncoder) -> Any:
    """The tower's transformers model (typed loosely: BERT, T5 encoder, ...)."""
    return encoder.backbone


def input_embeddings(encoder: DualEncoder) -> nn.Embedding:
    """The token embedding table (T5: ``shared``; BERT: ``embeddings.word_embeddings``)."""
    table = hf(encoder).get_input_embeddings()
    assert isinstance(table, nn.Embedding)
    return table


def _pooled_dim(encoder: DualEncoder) -> int:
    return int(hf(encoder).config.hidden_size)  # T5Config maps hidden_size to d_model


def build_towers(base_dir: Path, arch: Arch) -> Towers:
    """Both towers from the checkpoint at ``base_dir``, with ``arch``'s sharing."""
    arch = check_arch(arch)
    query = load_dual_encoder(base_dir)
    if arch == "sde":
        return Towers(arch, query, query)
    added = False
    if arch == "ade-spl" and query.dense is None:
        query.dense = identity_projection(_pooled_dim(query))
        added = True
    document = copy.deepcopy(query)
    towers = Towers(arch, query, document, added_projection=added)
    towers._tie()
    if arch == "ade-fte":
        input_embeddings(query).weight.requires_grad_(False)
    return towers


def save_tower(encoder: DualEncoder, base_dir: Path, out: Path, added_projection: bool) -> None:
    """Write ``encoder`` as a sentence-transformers checkpoint laid out like ``base_dir``.

    The base folder is copied (tokenizer, pooling and sentence-transformers configs), the
    transformer's weights are replaced by ``save_pretrained`` and the Dense layer's by
    ``model.safetensors`` with the key ``linear.weight`` (sentence-transformers' own).
    ``added_projection``: a ``2_Dense`` folder is written and inserted in ``modules.json``
    after the Pooling module.
    """
    from safetensors.torch import save_file

    layout = read_layout(base_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(base_dir).iterdir():
        if item.name in {"model.safetensors", "pytorch_model.bin", "onnx", "openvino"}:
            continue
        target = out / item.name
        if item.is_dir():
            if not (out / item.name).exists():
                shutil.copytree(item, target)
        else:
            shutil.copy2(item, target)
    transformer_out = out / layout.transformer_dir.relative_to(layout.root)
    for stale in ("pytorch_model.bin", "model.safetensors"):
        (transformer_out / stale).unlink(missing_ok=True)
    hf(encoder).save_pretrained(str(transformer_out))
    if encoder.dense is None:
        return
    linear = next(m for m in encoder.dense.modules() if isinstance(m, nn.Linear))
    if layout.dense is not None:
        dense_out = out / layout.dense.path.relative_to(layout.root)
        activation = layout.dense.activation
    else:
        if not added_projection:
            raise InvalidArgument("a Dense layer the base checkpoint does not have")
        dense_out = out / DENSE_DIR
        activation = IDENTITY
        modules = json.loads((out / "modules.json").read_text())
        if not any(str(m["type"]).endswith("Dense") for m in modules):
            at = 1 + next(i for i, m in enumerate(modules) if str(m["type"]).endswith("Pooling"))
            modules.insert(
                at,
                {
                    "idx": at,
                    "name": DENSE_DIR,
                    "path": DENSE_DIR,
                    "type": "sentence_transformers.models.Dense",
                },
            )
            for i, module in enumerate(modules):
                module["idx"] = i
            (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    dense_out.mkdir(parents=True, exist_ok=True)
    (dense_out / "pytorch_model.bin").unlink(missing_ok=True)
    (dense_out / "config.json").write_text(
        json.dumps(
            {
                "in_features": linear.in_features,
                "out_features": linear.out_features,
                "bias": linear.bias is not None,
                "activation_function": activation,
            },
            indent=2,
        )
        + "\n"
    )
    state = {"linear.weight": linear.weight.detach().contiguous()}
    if linear.bias is not None:
        state["linear.bias"] = linear.bias.detach().contiguous()
    save_file(state, str(dense_out / "model.safetensors"))


def save_towers(towers: Towers, base_dir: Path, out: Path) -> list[Path]:
    """SDE: ``out`` is the checkpoint; asymmetric: ``out/query`` and ``out/document``."""
    if not is_asymmetric(towers.arch):
        save_tower(towers.query, base_dir, out, False)
        return [Path(out)]
    paths = [Path(out) / "query", Path(out) / "document"]
    for path, tower in zip(paths, (towers.query, towers.document), strict=True):
        save_tower(tower, base_dir, path, towers.added_projection)
    return paths
