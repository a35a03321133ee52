"""The gateway's encoder: which one serves a generation, and what g1's record says of it.

Triton (production; on a CPU repository this gateway can read, queries embedded here by
the version's own query graph: :mod:`services.encoder.runtime.local_queries`) or the
model in this process (``--encoder inprocess``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.encoder.base import Encoder
from services.gateway.settings import GatewaySettings
from services.generations.registry import EncoderSpec
from services.rpc.balance import Balancing


async def build_encoder(
    settings: GatewaySettings,
    model: str = "",
    version: int = 0,
    model_dir: str | None = None,
    queries: bool = True,
) -> Encoder:
    """The configured encoder: Triton (production) or the model in this process. Triton:
    ``model`` (default ``--triton-model``) at ``version`` (0: the newest ready now,
    pinned), its queries run here when ``--query-repository`` allows and ``queries``
    (False: documents only, e.g. a dual write, which needs no query graph opened and
    probed); in-process: ``model_dir`` (default ``--model-dir``)."""
    if settings.encoder == "triton":
        from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

        name = model or settings.triton_model
        triton = await TritonEncoder.connect(
            TritonEncoderConfig(
                url=settings.triton_url,
                model=name,
                model_version=str(version) if version else "",
                default_timeout_s=settings.default_timeout_s,
                tls=settings.triton_client_tls(),
                balancing=Balancing(settings.balance, settings.resolve_every_s),
            )
        )
        if not (queries and settings.query_repository):
            return triton
        from services.encoder.runtime.local_queries import with_local_queries

        return await with_local_queries(triton, Path(settings.query_repository), name)
    from services.encoder.runtime.inprocess import InProcessEncoder

    folder = model_dir or settings.model_dir
    return await asyncio.to_thread(InProcessEncoder.torch, Path(folder) if folder else None)


def encoder_spec(settings: GatewaySettings, encoder: Encoder) -> EncoderSpec:
    """What the gateway's own encoder is, for generation g1's record when the gateway is
    the first to record it: Triton's model at the version it pinned, or the in-process
    model's folder."""
    if settings.encoder == "triton":
        return EncoderSpec(
            model=settings.triton_model,
            version=int(getattr(encoder, "model_version", 0) or 0),
            dim=encoder.dim,
            digest=str(getattr(encoder, "digest", "") or ""),
            source=encoder.model_name,
        )
    from services.encoder.model import default_model_dir

    folder = settings.model_dir or str(default_model_dir())
    return EncoderSpec(model=encoder.model_name, dim=encoder.dim, source=folder)
