"""The embedded default corpus: the documentation of the Python standard library.

Every machine with Python has it, so a newcomer can search something real without
bringing data: each public module, class, function and method with a docstring becomes
one document whose title is its qualified name (``csv.DictReader``) and whose text is
its docstring (with the signature when one can be read).

Modules are imported to read their docstrings, in a child process by default
(:func:`collect_in_subprocess`) so that modules with import side effects (``this``,
``antigravity``, GUI toolkits) cannot disturb the caller.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

# Modules that open windows, print on import, start browsers, or only exist on other
# platforms; and private/test packages.
_SKIP_PREFIXES = (
    "_",
    "test",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "this",
    "antigravity",
    "lib2to3",
    "ensurepip",
    "venv",
    "pydoc_data",
    "msilib",
    "winreg",
    "winsound",
    "msvcrt",
    "nt",
    "_winapi",
    "distutils",
    "unittest.test",
    "ctypes.test",
    "sqlite3.test",
    "idle",
    "__main__",
    "xxsubtype",
    "xxlimited",
    "encodings.",
)
MIN_DOC_CHARS = 40


@dataclass(frozen=True)
class StdlibDoc:
    id: str
    title: str
    text: str
    kind: str
    module: str

    def as_json(self) -> dict[str, object]:
        return {
            "_id": self.id,
            "title": self.title,
            "text": self.text,
            "metadata": {"kind": self.kind, "module": self.module},
        }


def _public_module_names() -> list[str]:
    names = set(sys.stdlib_module_names)
    out = []
    for name in sorted(names):
        if name.startswith(_SKIP_PREFIXES):
            continue
        out.append(name)
    return out


def _submodules(module: object) -> list[str]:
    path = getattr(module, "__path__", None)
    if not path:
        return []
    prefix = module.__name__ + "."  # type: ignore[attr-defined]
    subs = []
    for info in pkgutil.iter_modules(path, prefix):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf.startswith("_") or info.name.startswith(_SKIP_PREFIXES) or "test" in leaf:
            continue
        subs.append(info.name)
    return subs


def _clean(doc: str | None) -> str:
    return inspect.cleandoc(doc) if doc else ""


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except Exception:
        return ""


def _docs_of_module(name: str) -> Iterator[StdlibDoc]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(name)
        except BaseException:
            return
    mdoc = _clean(module.__doc__)
    if len(mdoc) >= MIN_DOC_CHARS:
        yield StdlibDoc(name, name, mdoc, "module", name)
    public = getattr(module, "__all__", None)
    members = (
        public
        if isinstance(public, list | tuple)
        else [n for n in dir(module) if not n.startswith("_")]
    )
    for member in members:
        obj = getattr(module, member, None)
        if obj is None or not _is_home(name, getattr(obj, "__module__", None)):
            continue  # re-exported from another public module: documented at its home
        if inspect.isclass(obj):
            yield from _docs_of_class(name, member, obj)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            doc = _clean(obj.__doc__)
            if len(doc) >= MIN_DOC_CHARS:
                qual = f"{name}.{member}"
                yield StdlibDoc(qual, qual, f"{member}{_signature(obj)}\n{doc}", "function", name)


def _is_home(module: str, defined_in: str | None) -> bool:
    """True when ``module`` is where a member is documented: where it is defined, or the
    public face of the private module that defines it (``csv.reader`` lives in ``_csv``)."""
    if defined_in is None or defined_in == module:
        return True
    return any(part.startswith("_") for part in defined_in.split("."))


def _docs_of_class(module: str, name: str, cls: type) -> Iterator[StdlibDoc]:
    qual = f"{module}.{name}"
    doc = _clean(cls.__doc__)
    if len(doc) >= MIN_DOC_CHARS:
        yield StdlibDoc(qual, qual, f"class {name}{_signature(cls)}\n{doc}", "class", module)
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
        if not (inspect.isfunction(func) or inspect.ismethoddescriptor(func)):
            continue
        mdoc = _clean(getattr(func, "__doc__", None))
        if len(mdoc) >= MIN_DOC_CHARS:
            mq = f"{qual}.{attr}"
            yield StdlibDoc(mq, mq, f"{attr}{_signature(func)}\n{mdoc}", "method", module)


def collect(limit: int | None = None) -> list[StdlibDoc]:
    """Collect the documents in this process (imports many modules: prefer the subprocess)."""
    seen: set[str] = set()
    docs: list[StdlibDoc] = []
    queue = _public_module_names()
    visited: set[str] = set()
    while queue:
        name = queue.pop(0)
        if name in visited:
            continue
        visited.add(name)
        for doc in _docs_of_module(name):
            if doc.id not in seen:
                seen.add(doc.id)
                docs.append(doc)
                if limit is not None and len(docs) >= limit:
                    return docs
        module = sys.modules.get(name)
        if module is not None:
            queue.extend(s for s in _submodules(module) if s not in visited)
    return docs


def collect_in_subprocess(limit: int | None = None, timeout: float = 300.0) -> list[StdlibDoc]:
    """Collect the documents in a child interpreter and return them (one JSON per line)."""
    code = (
        "import json, sys\n"
        "from services.corpus.stdlib import collect\n"
        f"for d in collect({limit!r}):\n"
        "    sys.stdout.write(json.dumps(d.as_json()) + '\\n')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"collecting stdlib docs failed: {proc.stderr[-2000:]}")
    docs = []
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        meta = row["metadata"]
        docs.append(StdlibDoc(row["_id"], row["title"], row["text"], meta["kind"], meta["module"]))
    return docs


def write_jsonl(docs: list[StdlibDoc], path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc.as_json()) + "\n")


__all__ = ["StdlibDoc", "asdict", "collect", "collect_in_subprocess", "write_jsonl"]
