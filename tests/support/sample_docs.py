"""A few stdlib-like documents that the end-to-end and gateway tests ingest and then
search for by meaning (``read a csv file`` finds ``py-csv``): ``(id, title, text)``."""

from __future__ import annotations

STDLIB_DOCS: list[tuple[str, str, str]] = [
    ("py-csv", "csv.reader", "Read rows of a comma-separated values file one list at a time."),
    ("py-json", "json.loads", "Deserialize a JSON document from a string to a Python object."),
    ("py-hash", "hashlib.sha256", "Return a SHA-256 hash object; update it with bytes."),
    ("py-thread", "ThreadPoolExecutor", "Run callables asynchronously in a pool of threads."),
]
