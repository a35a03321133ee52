"""Stage the generated Triton model repository for one encoder size profile.

Usage: prepare_model_repository.py SOURCE DEST INSTANCE_COUNT KIND [--watch SECONDS
       --triton-http URL]

SOURCE is the repository `gtr-retrieval encoder export` wrote (read-only, shared).
DEST gets one directory per model: every entry of the source model is symlinked (the
engines are large and never copied) except config.pbtxt, which is rewritten with the
count of each instance_group of kind KIND (KIND_GPU for the GPU flavour, KIND_CPU for
the CPU one) set to INSTANCE_COUNT. Other groups (the GPU flavour's CPU tokenizer) and
models without one (the `embed` ensemble) keep their config. Fails when no group of
KIND exists, since the profile's instance count would then silently not apply.

With --watch (the Triton pod's repository-sync sidecar, encoder.repositorySync) it stages
again every SECONDS: a version folder a rollout published into SOURCE (`index rollout
--encoder`, issue #24) is linked, a removed one unlinked, a changed config rewritten, and
every model whose entries or config changed is loaded again through the Triton at URL
(POST /v2/repository/models/<model>/load, explicit model control), so every Triton pod
serves the new version beside the serving one, without a restart.
"""

import os
import re
import sys

# `instance_group { count: 1 kind: KIND_GPU }` (protobuf text format, one block per
# group) or `instance_group [ { ... } ]`.
GROUP = re.compile(r"(instance_group\s*(?:\[\s*)?\{)([^}]*)(\})")
COUNT = re.compile(r"\bcount\s*:\s*\d+")


def rewrite(config: str, count: int, kind: str) -> tuple[str, int]:
    """Set the count of every instance group of ``kind``; return the text and how many."""
    changed = 0

    def patch(match: re.Match[str]) -> str:
        nonlocal changed
        body = match.group(2)
        if not re.search(rf"\bkind\s*:\s*{kind}\b", body):
            return match.group(0)
        changed += 1
        if COUNT.search(body):
            body = COUNT.sub(f"count: {count}", body, count=1)
        else:
            body = f" count: {count}{body}"
        return f"{match.group(1)}{body}{match.group(3)}"

    return GROUP.sub(patch, config), changed


def stage(source: str, dest: str, count: int, kind: str) -> tuple[list[str], list[str]]:
    """Stage SOURCE into DEST; the models whose group was patched, and those whose staged
    entries or config changed (new, removed or re-pointed links, another config)."""
    patched: list[str] = []
    changed: list[str] = []
    for model in sorted(os.listdir(source)):
        src_model = os.path.join(source, model)
        if not os.path.isdir(src_model):
            continue
        dst_model = os.path.join(dest, model)
        os.makedirs(dst_model, exist_ok=True)
        differs = False
        # Dotted entries (encoder publish's lock and a version being staged) are not
        # linked: Triton takes any non-version entry of a model folder newer than a
        # version's load for a change of that version, and reloads every version.
        entries = {e for e in os.listdir(src_model) if not e.startswith(".")} - {"config.pbtxt"}
        for entry in sorted(entries):
            link = os.path.join(dst_model, entry)
            target = os.path.join(src_model, entry)
            if os.path.islink(link) and os.readlink(link) == target:
                continue
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(target, link)
            differs = True
        for entry in os.listdir(dst_model):
            link = os.path.join(dst_model, entry)
            if entry not in entries and entry != "config.pbtxt" and os.path.islink(link):
                os.remove(link)  # a version removed from the source
                differs = True
        config_path = os.path.join(src_model, "config.pbtxt")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as fh:
                config, n = rewrite(fh.read(), count, kind)
            staged = os.path.join(dst_model, "config.pbtxt")
            old = None
            if os.path.exists(staged):
                with open(staged, encoding="utf-8") as fh:
                    old = fh.read()
            if old != config:
                with open(staged, "w", encoding="utf-8") as fh:
                    fh.write(config)
                differs = True
            if n:
                patched.append(model)
        if differs:
            changed.append(model)
    return patched, changed


def load(triton_http: str, model: str) -> None:
    """Ask Triton to load ``model`` again (new versions load, the serving ones keep serving
    until it is done)."""
    import urllib.request

    url = f"{triton_http.rstrip('/')}/v2/repository/models/{model}/load"
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=600) as reply:
        reply.read()


def loaded(triton_http: str) -> set[str]:
    """The models Triton has loaded (READY), from its repository index."""
    import json
    import urllib.request

    url = f"{triton_http.rstrip('/')}/v2/repository/index"
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as reply:
        index = json.loads(reply.read())
    return {m["name"] for m in index if m.get("state") == "READY"}


def watch(source: str, dest: str, count: int, kind: str, every: float, triton_http: str) -> int:
    import time

    while True:
        time.sleep(every)
        try:
            _, changed = stage(source, dest, count, kind)
            if changed:
                ready = loaded(triton_http)
                for model in changed:
                    if model in ready:
                        print(f"{model}: the repository changed, loading it again", flush=True)
                        load(triton_http, model)
        except OSError as exc:  # Triton restarting, the volume briefly away: next round
            print(f"repository sync: {exc}", file=sys.stderr, flush=True)


def main(source: str, dest: str, count: int, kind: str) -> int:
    if count < 1 or kind not in ("KIND_GPU", "KIND_CPU"):
        print(f"need a count >= 1 and KIND_GPU|KIND_CPU, got {count} {kind}", file=sys.stderr)
        return 2
    patched, _ = stage(source, dest, count, kind)
    if not patched:
        print(f"no model in {source} has an instance_group of {kind}", file=sys.stderr)
        return 1
    print(f"instance count {count} ({kind}) set on: {', '.join(patched)}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 8 and args[4] == "--watch" and args[6] == "--triton-http":
        status = main(args[0], args[1], int(args[2]), args[3])
        if status:
            sys.exit(status)
        sys.exit(watch(args[0], args[1], int(args[2]), args[3], float(args[5]), args[7]))
    if len(args) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[0], args[1], int(args[2]), args[3]))
