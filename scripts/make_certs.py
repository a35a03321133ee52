"""Make a throwaway CA and certificates for the local stack and tests.

    .venv/bin/python scripts/make_certs.py OUT_DIR [--name gtr-gateway.ns.svc ...] [--days 30]

Writes ca.pem/ca.key, server.pem/server.key (SANs: localhost, 127.0.0.1, ::1 and every
--name) and client.pem/client.key into OUT_DIR (keys mode 0600); see
services/stack/certs.py. `gtr-retrieval up --tls` does the same in its run directory.
Not for production certificates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.stack.certs import make_certs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("out_dir", type=Path, help="Directory to write the PEM files to.")
    parser.add_argument(
        "--name",
        action="append",
        default=[],
        help="Extra DNS name or IP of the server certificate (repeatable), e.g. the "
        "chart's Service names: gtr-gateway.<namespace>.svc",
    )
    parser.add_argument("--days", type=int, default=30, help="Validity in days (default 30).")
    args = parser.parse_args(argv)
    files = make_certs(args.out_dir, args.name, days=args.days)
    for label, path in [
        ("CA", files.ca),
        ("server certificate", files.server_cert),
        ("server key", files.server_key),
        ("client certificate", files.client_cert),
        ("client key", files.client_key),
    ]:
        print(f"{label:<20} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
