"""Stage the generated Triton model repository for one encoder size profile.

Usage: prepare_model_repository.py SOURCE DEST INSTANCE_COUNT KIND

SOURCE is the repository `gtr-retrieval encoder export` wrote (read-only, shared).
DEST gets one directory per model: every entry of the source model is symlinked (the
engines are large and never copied) except config.pbtxt, which is rewritten with the
count of each instance_group of kind KIND (KIND_GPU for the GPU flavour, KIND_CPU for
the CPU one) set to INSTANCE_COUNT. Other groups (the GPU flavour's CPU tokenizer) and
models without one (the `embed` ensemble) keep their config. Fails when no group of
KIND exists, since the profile's instance count would then silently not apply.
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


def main(source: str, dest: str, count: int, kind: str) -> int:
    if count < 1 or kind not in ("KIND_GPU", "KIND_CPU"):
        print(f"need a count >= 1 and KIND_GPU|KIND_CPU, got {count} {kind}", file=sys.stderr)
        return 2
    patched = []
    for model in sorted(os.listdir(source)):
        src_model = os.path.join(source, model)
        if not os.path.isdir(src_model):
            continue
        dst_model = os.path.join(dest, model)
        os.makedirs(dst_model, exist_ok=True)
        for entry in os.listdir(src_model):
            if entry == "config.pbtxt":
                continue
            link = os.path.join(dst_model, entry)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.join(src_model, entry), link)
        config_path = os.path.join(src_model, "config.pbtxt")
        if not os.path.isfile(config_path):
            continue
        with open(config_path, encoding="utf-8") as fh:
            config, n = rewrite(fh.read(), count, kind)
        with open(os.path.join(dst_model, "config.pbtxt"), "w", encoding="utf-8") as fh:
            fh.write(config)
        if n:
            patched.append(model)
    if not patched:
        print(f"no model in {source} has an instance_group of {kind}", file=sys.stderr)
        return 1
    print(f"instance count {count} ({kind}) set on: {', '.join(patched)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
