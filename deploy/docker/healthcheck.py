"""Container health check of a gtr-retrieval process: its gRPC health service says SERVING.

Run by the image's HEALTHCHECK (Docker, Podman). The port is GTR_HEALTH_PORT, else the
GTR_<SERVICE>_PORT the role was started with (gateway, shard, rerank), else 50051.
Exit 0 when SERVING, 1 otherwise (the runtime's contract).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PORT_VARIABLES = ("GTR_HEALTH_PORT", "GTR_GATEWAY_PORT", "GTR_SHARD_PORT", "GTR_RERANK_PORT")


def port() -> int:
    for name in PORT_VARIABLES:
        value = os.environ.get(name)
        if value:
            return int(value)
    return 50051


def main() -> int:
    target = f"127.0.0.1:{port()}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=3.0
            )
        except grpc.RpcError as err:
            print(f"{target}: {err.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
