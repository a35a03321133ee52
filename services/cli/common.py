"""What the ``gtr-retrieval`` sub-commands share: argument types and the handler wrapper.

A flag that takes a count or a size refuses, at parse time with argparse's usage error
(exit 2), what its command cannot use, instead of a ValueError traceback later:
``positive_int`` (1 and up), ``non_negative_int`` (0 and up) and ``uint32`` (what a
request's uint32 field can carry). ``run_handler`` runs a command's handler and turns a
domain error (bad input, a missing file, no GPU here) into ``error: <message>`` on stderr
and exit status 2; ``add_command`` registers a sub-command whose handler runs so.
``tls_flags`` and ``client_tls`` read a command's ``--tls-*`` (shard replicas) or
``--triton-*`` (Triton) client TLS flags the one way every command does: half a key pair,
or a file that is not PEM, is such a domain error naming the flags. ``triton_tls`` is
Triton's TLS of the files a command resolved: a client certificate without a CA is such an
error too, naming ``--triton-ca``.
``config_from_args`` builds a command's dataclass config from its flags by field name.
``add_group`` adds a command that only groups sub-commands (``gtr-retrieval index …``);
``group_commands`` finds that list again for a module that adds to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.errors import RetrievalError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

UINT32_MAX = 2**32 - 1
# `encoder publish` and `index rollout --encoder`: services.encoder.build.int8_recheck
INT8_UNMEASURED_HELP = (
    "serve an export's int8 graphs that no quality gate result holds for (their parity "
    "against the export's FP32 graph is checked either way); without it they are refused"
)

C = TypeVar("C", bound="DataclassInstance")


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def uint32(text: str) -> int:
    """A whole number a request carries as uint32: refused here when it cannot be sent (a
    negative -k used to end in a ValueError traceback); its range is the gateway's."""
    value = _whole_number(text)
    if not 0 <= value <= UINT32_MAX:
        raise argparse.ArgumentTypeError(f"{value} is out of range (0..{UINT32_MAX})")
    return value


def run_handler(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``handler(args)``; a :class:`RetrievalError` is said on stderr and exits 2."""
    try:
        return int(handler(args))
    except RetrievalError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


def reachable_store(url: str, flag: str = "--redis-url", socket_timeout: float = 30.0) -> Any:
    """A client of the store at ``url`` once it answered a PING
    (:func:`~services.process.redis_client.answering_client`); its refusal (Unavailable,
    Unauthenticated) names ``flag``. A one-shot command otherwise ended in a redis-py
    traceback at its first read."""
    from services.common.errors import Unavailable
    from services.process.redis_client import answering_client

    try:
        return answering_client(url, to="run this command", socket_timeout=socket_timeout)
    except Unavailable as exc:
        raise Unavailable(
            f"{flag}: {exc.message}; start it (or the local stack, `gtr-retrieval up`) or "
            "give the URL of a running one"
        ) from None
    except RetrievalError as exc:  # the credentials refused
        raise type(exc)(f"{flag}: {exc.message}") from None


def add_command(
    commands: Any, name: str, handler: Callable[[argparse.Namespace], int], **parser: Any
) -> argparse.ArgumentParser:
    """``commands.add_parser(name, **parser)`` whose ``func`` is ``handler`` under
    :func:`run_handler`; the caller adds the flags."""
    p: argparse.ArgumentParser = commands.add_parser(name, **parser)
    p.set_defaults(func=lambda args: run_handler(handler, args))
    return p


def add_group(commands: Any, name: str, *, metavar: str = "ACTION", **parser: Any) -> Any:
    """``commands.add_parser(name, **parser)`` for a command that only groups
    sub-commands (``gtr-retrieval index train``): one of them is required, its name is
    ``args.<name>_command``. Returns the list to add them to."""
    group = commands.add_parser(name, **parser)
    return group.add_subparsers(dest=f"{name}_command", metavar=metavar, required=True)


def group_commands(commands: Any, name: str) -> Any:
    """The sub-command list of the group ``name`` that :func:`add_group` made, for a module
    that adds more to it (``index rollout`` beside ``index train``)."""
    for action in commands.choices[name]._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError(f"the {name} command has no sub-commands")


def config_from_args(cls: type[C], args: argparse.Namespace, **explicit: Any) -> C:
    """The dataclass ``cls`` from a command's flags: a field takes the value of the flag
    whose dest is its name; ``explicit`` gives the fields no flag maps to 1:1 (a renamed,
    negated or converted flag) and wins; any other field keeps the class's default.
    ``explicit`` naming no field of ``cls`` is a TypeError, as the constructor's would be."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(explicit) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    given = {name: getattr(args, name) for name in names - set(explicit) if hasattr(args, name)}
    return cls(**given, **explicit)


def tls_flags(args: argparse.Namespace, prefix: str) -> tuple[str | None, str | None, str | None]:
    """(CA, client certificate, client key) as given by ``--<prefix>-ca``,
    ``--<prefix>-client-cert`` and ``--<prefix>-client-key`` (``prefix``: "tls" for the
    shard replicas, "triton" for Triton). Half a key pair is :class:`InvalidArgument`
    naming both flags (exit 2 under :func:`run_handler`), checked on the flags as given,
    before any default fills the other half in: a certificate from the command line with
    the local stack's key would only fail later, at the handshake."""
    from services.common.errors import InvalidArgument

    ca, cert, key = (
        getattr(args, f"{prefix}_{n}", None) for n in ("ca", "client_cert", "client_key")
    )
    if bool(cert) != bool(key):
        given, missing = ("cert", "key") if cert else ("key", "cert")
        raise InvalidArgument(
            f"--{prefix}-client-cert and --{prefix}-client-key go together: "
            f"--{prefix}-client-{given} was given without --{prefix}-client-{missing}"
        )
    return ca or None, cert or None, key or None


def client_tls(ca: str | None, cert: str | None, key: str | None, what: str) -> Any:
    """The :class:`~services.rpc.tls.ClientTLS` of these files (None: plaintext), its
    files read and its key pair matched now; a file that cannot be is
    :class:`InvalidArgument` saying ``what`` it was for."""
    from services.common.errors import InvalidArgument
    from services.rpc.tls import ClientTLS

    try:
        tls = ClientTLS.from_paths(ca, cert, key)
        if tls is not None:
            tls.check()
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None
    return tls


def triton_tls(
    ca: str | None, cert: str | None, key: str | None, stack: Mapping[str, str] | None = None
) -> Any:
    """Triton's :class:`~services.rpc.tls.ClientTLS` of a command's ``--triton-*``
    flags, each missing one taken from the local stack's ``internal_tls`` files (``stack``:
    the CA, or the client key pair): None (plaintext) without any.
    The CLI talks TLS to Triton only with a CA to trust, so a client certificate without
    one is :class:`InvalidArgument` naming ``--triton-ca``: it used to be dropped without a
    word and Triton reached in plaintext. (The gateway has no Triton flags of its own: its
    ``--tls-client-*`` without ``--tls-ca`` is TLS trusting the system's roots.)"""
    from services.common.errors import InvalidArgument

    paths = stack or {}
    ca = ca or paths.get("ca")
    if not cert:
        cert, key = paths.get("cert"), paths.get("key")
    if not ca:
        if cert or key:
            raise InvalidArgument(
                "--triton-client-cert and --triton-client-key need --triton-ca (the CA that "
                "signed Triton's certificate): without it Triton would be reached in "
                "plaintext and the client certificate not used"
            )
        return None
    return client_tls(ca, cert, key, "Triton's TLS")
