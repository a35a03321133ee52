"""The handlers of ``index rollout | rollback | retire | generations``: flags into calls
of :mod:`services.generations.operations` and the builder, results into words
(docs/generations.md). Every decision is the package's; this module says what happened."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from services.cli import generation_places as at

# `index retire`'s exit status when the generation was retired but its encoder version
# stays published (Triton could not be asked, or refused the load): not 0, so a script or
# Job notices what is left to do; not 2 (a refusal: nothing changed), since it did retire.
ENCODER_KEPT = 3

COST = (
    "During a rollout the new generation's shards run beside the serving one's (about "
    "twice the index's memory, and Triton serves both encoder versions); a reshard also "
    "copies the documents into the new shard count's keys (a second copy of the document "
    "store until the old generation is retired)."
)


def rollout(args: argparse.Namespace) -> int:
    from services.generations import operations as ops
    from services.generations.registry import Registry
    from services.process.cpus import budget_for, pin_process

    budget = budget_for(args.cpus) if args.cpus else None
    if budget:  # from here on (the export of --encoder too) this process runs there
        pin_process(os.getpid(), budget)
    # the plan first: a bad --retrieval-setting is refused before anything is reached
    plan = None if args.abort else _plan(args)
    where = at.places(args)
    store = at.client(where.redis_url)
    if plan is None:
        return _say_aborted(ops.abort_rollout(at.builder(args, where, store)))
    # a live builder or other options: refused (naming it) before asking anything
    intent = ops.intend_rollout(at.builder(args, where, store), plan)
    if not at.confirm(args, _question(args, intent)):
        return 1
    progress = at.progress(args)
    started = time.monotonic()
    try:
        with at.in_flags():
            serving = ops.run_rollout(
                lambda publisher: at.builder(args, where, store, progress, publisher),
                intent,
                budget=budget,
                client=store,
                triton_repo=where.triton_repo,
                publish=at.publish_on(where),
            )
    finally:
        progress.close()
    registry = Registry(store)
    print(
        f"{serving.name} serves ({serving.num_shards} shards, encoder "
        f"{serving.encoder.model} v{serving.encoder.version}) after "
        f"{time.monotonic() - started:.0f} s; `index rollback` returns to "
        f"{registry.alias().previous}"
    )
    _note_displaced(registry)
    return 0


def _plan(args: argparse.Namespace) -> Any:
    """``index rollout``'s plan of its flags (a bad --retrieval-setting file: the error
    names the flag)."""
    from services.common.errors import InvalidArgument, NotFound
    from services.generations.operations import plan_of

    try:
        return plan_of(
            args.encoder,
            args.shards,
            args.retrain,
            args.retrieval_setting,
            args.int8_unmeasured,
        )
    except (InvalidArgument, NotFound) as exc:
        raise type(exc)(f"--retrieval-setting {exc.message}") from None


def _question(args: argparse.Namespace, intent: Any) -> str:
    resumes = intent.resumes
    if resumes is not None:
        return (
            f"resume the rollout to {resumes.target} from {resumes.source} (phase {resumes.phase})?"
        )
    serving = intent.serving
    change = {
        "encoder": f"encoder {args.encoder}",
        "retrain": "the quantizer retrained on the stored vectors",
        "reembed": f"{serving.encoder.model} v{serving.encoder.version} re-embedded",
    }[intent.change]
    setting = intent.plan.retrieval
    return (
        f"roll out a new generation from {serving.name} ({serving.num_shards} shards): "
        f"{change}, {intent.num_shards} shards"
        + (f", retrieval setting: {setting.describe()}" if setting is not None else "")
        + f".\n{COST}\nGo ahead?"
    )


def _say_aborted(aborted: Any) -> int:
    state = aborted.state
    target = state.target
    if aborted.target_state is None:  # stopped before its target was recorded
        print(
            f"aborted the rollout to {target} (phase publish): {state.source} "
            f"serves and takes the writes as before; {target} was never recorded. If "
            "its encoder was published before it stopped, no generation uses that "
            "version: `gtr-retrieval encoder versions` lists it, `encoder unpublish "
            "--version N` frees it"
        )
        return 0
    print(
        f"aborted the rollout to {target} (phase {state.phase}): "
        f"{state.source} takes the writes; {target} is {aborted.target_state}"
    )
    return 0


def _note_displaced(registry: Any) -> None:
    """Say which generations still run their shards though no rollback can reach them."""
    from services.generations.operations import displaced

    for gen in displaced(registry):
        print(
            f"note: {gen.name} is no longer the rollback target but its shards still "
            f"run: `index retire --generation {gen.name}` frees them"
        )


def rollback(args: argparse.Namespace) -> int:
    import asyncio

    from services.generations.registry import Registry

    where = at.places(args)
    store = at.client(where.redis_url)
    alias = Registry(store).alias()
    question = f"roll back from {alias.serving} to {alias.previous or '(none)'}?"
    if alias.previous and not at.confirm(args, question):
        return 1
    progress = at.progress(args)
    started = time.monotonic()
    try:
        with at.in_flags():
            serving = asyncio.run(at.builder(args, where, store, progress).rollback())
    finally:
        progress.close()
    print(
        f"{serving.name} serves again after {time.monotonic() - started:.0f} s "
        f"({alias.serving} is previous)"
    )
    _note_displaced(Registry(store))
    return 0


def retire(args: argparse.Namespace) -> int:
    from services.generations.lifecycle import retire as retire_generation
    from services.generations.operations import retire_choice
    from services.generations.registry import Registry

    where = at.places(args)
    store = at.client(where.redis_url)
    registry = Registry(store)
    name = retire_choice(registry, args.generation)  # NotFound before asking
    question = (
        f"retire {name} (its logs and keys deleted; its encoder version unpublished "
        "from Triton when no other generation uses it)?"
    )
    if name is not None and not at.confirm(args, question):
        return 1
    done = retire_generation(store, args.generation)
    print(
        f"{done.generation.name} retired: {done.keys_deleted} keys deleted"
        + (
            f", {done.documents_deleted} documents of its {done.generation.num_shards}-shard layout"
            if done.documents_deleted
            else ""
        )
    )
    return _release_encoder(args, where, registry, done.generation)


def _unpublish_later(args: argparse.Namespace, where: at.Places, version: int) -> str:
    """The `encoder unpublish` command that frees ``version`` later, with these flags."""
    return f"gtr-retrieval encoder unpublish --version {version}" + "".join(
        f" {flag} {value}"
        for flag, value in (
            ("--repo", where.triton_repo or "DIR"),
            ("--triton-url", where.triton_url or ("URL" if not where.triton_repo else "")),
            ("--run-dir", args.stack_run_dir),
            ("--triton-ca", args.triton_ca),
            ("--triton-client-cert", args.triton_client_cert),
            ("--triton-client-key", args.triton_client_key),
        )
        if value
    )


def _release_encoder(args: argparse.Namespace, where: at.Places, registry: Any, gen: Any) -> int:
    """Say what became of ``gen``'s version of embed (the decision is
    :func:`services.generations.encoders.release_encoder`'s); 0, or ENCODER_KEPT when it
    could not be unpublished."""
    from services.generations.encoders import release_encoder

    done = release_encoder(registry, gen, where.triton_repo, where.triton_url, where.triton_tls)
    version = done.version
    later = _unpublish_later(args, where, version)
    if done.outcome == "kept":
        print(f"embed version {version} stays published: the encoder of {', '.join(done.users)}")
    elif done.outcome == "no_repository":
        print(
            f"note: embed version {version} is no longer used by any generation but stays "
            "published: no Triton model repository named (--triton-repo, or --run-dir of "
            f"the local stack); `{later}` frees it",
            file=sys.stderr,
        )
    elif done.outcome == "absent":
        print(f"embed version {version} is not in {where.triton_repo}: nothing to unpublish")
    elif done.outcome == "failed":
        message = done.error.message if done.error is not None else ""
        print(
            f"warning: {gen.name} is retired, but embed version {version}, its encoder, is "
            f"still published (Triton keeps it loaded): {message}\nrun `{later}` once "
            f"Triton answers (or `index retire --generation {gen.name}` again)",
            file=sys.stderr,
        )
        return ENCODER_KEPT
    else:
        where_ = (
            f" and unloaded by Triton at {where.triton_url}"
            if where.triton_url
            else (" (no Triton named: one serving it unloads it at its next load or restart)")
        )
        print(
            f"embed version {version} (no other generation uses it) unpublished from "
            f"{where.triton_repo}{where_}"
        )
    return 0


def generations(args: argparse.Namespace) -> int:
    from services.generations.operations import status

    where = at.places(args)
    listed = status(at.client(where.redis_url), where.shard_tls)
    if args.json:
        print(json.dumps(listed.to_json(), indent=2, sort_keys=True))
        return 0
    header = ("NAME", "STATE", "ALIAS", "SHARDS", "ENCODER", "DOCS", "BYTES", "DRIFT", "REPLICAS")
    table = [header, *(_row(r) for r in listed.rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    for r in listed.rows:  # only the generations that carry one (issue #35)
        if r.get("retrieval"):
            print(f"{r['name']} retrieval setting: {_setting(r['retrieval'])}")
    print(f"alias epoch {listed.alias.epoch}")
    running = listed.rollout
    if running is not None:
        print(
            f"rollout {running.source} -> {running.target} ({running.kind}, {running.mode}): "
            f"phase {running.phase}, {running.done}/{running.total or '?'} documents, "
            f"builder pid {'' if running.pid is None else running.pid} on {running.host}, "
            f"last heard {time.time() - running.beat:.0f} s ago"
        )
    return 0


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    enc = r["encoder"]
    return (
        r["name"],
        r["state"],
        r["alias"] or "-",
        str(r["num_shards"]),
        f"{enc['model']} v{enc['version']} {enc['dim']}-d"
        + (f" ({Path(enc['source']).name})" if enc.get("source") else ""),
        _n(r["documents"]),
        _bytes(r["bytes"]),
        "-" if r["drift"] is None else f"{r['drift']:.2f}",
        f"{r['replicas_up']}/{r['replicas']}" if r["replicas"] else "-",
    )


def _setting(raw: dict[str, Any]) -> str:
    from services.common.retrieval_setting import RetrievalSetting

    return RetrievalSetting.from_dict(raw).describe()


def _n(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "?"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
