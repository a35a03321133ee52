"""What a write token means once the serving generation has changed (docs/generations.md,
"Write tokens across a switch"): the rule the gateway applies to every SESSION search,
kept here with the rest of the generations' policy; the gateway only passes its cached
alias in."""

from __future__ import annotations

from services.common.domain import TokenOrigin, WriteToken
from services.common.errors import InvalidArgument
from services.common.positions import merge_tokens
from services.index.keys import FIRST_GENERATION


def resolve_token(
    token: WriteToken,
    origin: TokenOrigin,
    *,
    generation: str,
    epoch: int,
    switch_in: WriteToken,
) -> WriteToken:
    """The positions in the serving ``generation``'s logs (alias ``epoch``; its logs'
    positions at its switch-in ``switch_in``) that a SESSION search with ``token`` (taken
    in ``origin``) must wait for.

    Same epoch: the token as it is. Older epoch (a token without origin counts as g1's,
    from before any switch): the serving generation's ``switch_in`` positions, merged
    with the token's own when it names the serving generation (its positions are in the
    same logs: g1 serving again after a rollback). A newer epoch than the alias's is
    InvalidArgument (the caller re-reads the alias before it concludes that).
    """
    named = origin.generation or FIRST_GENERATION
    if origin.epoch > epoch:
        raise InvalidArgument(
            f"write_token: epoch {origin.epoch} is newer than this store's alias (epoch "
            f"{epoch}, generation {generation}): a token of another store?"
        )
    if origin.epoch == epoch:
        if named != generation:
            raise InvalidArgument(
                f"write_token: epoch {origin.epoch} is generation {generation}'s in "
                f"this store, not {named}'s: a token of another store?"
            )
        return token
    own = token if named == generation else {}
    return merge_tokens(switch_in, own)
