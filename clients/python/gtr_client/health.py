"""The gRPC health service's two messages (``grpc.health.v1``), without its package.

``grpcio-health-checking`` would be one more dependency for two one-field messages, and
its generated module registers ``grpc/health/v1/health.proto`` in protobuf's default
descriptor pool, where a second copy of that file (ours, generated) would clash in a
process that also imports it (a server in the same process). So the two messages are
built from their descriptor in a pool of their own, on first use: the same bytes on the
wire, no name shared with anyone.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from gtr_client.types import HealthStatus

CHECK_METHOD = "/grpc.health.v1.Health/Check"
_PACKAGE = "grpc.health.v1"
_STATUS = {
    0: HealthStatus.UNKNOWN,
    1: HealthStatus.SERVING,
    2: HealthStatus.NOT_SERVING,
    3: HealthStatus.SERVICE_UNKNOWN,
}


@functools.cache
def messages() -> tuple[type[Any], type[Any]]:
    """(HealthCheckRequest, HealthCheckResponse) message classes."""
    fd = descriptor_pb2.FileDescriptorProto(
        name="gtr_client/grpc_health_v1.proto", package=_PACKAGE, syntax="proto3"
    )
    request = fd.message_type.add(name="HealthCheckRequest")
    request.field.add(
        name="service",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    response = fd.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, value in _STATUS.items():
        status.value.add(name=value.name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
        type_name=f".{_PACKAGE}.HealthCheckResponse.ServingStatus",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return (
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName(f"{_PACKAGE}.HealthCheckRequest")
        ),
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName(f"{_PACKAGE}.HealthCheckResponse")
        ),
    )


def request(service: str = "") -> bytes:
    """A serialized HealthCheckRequest (``""``: the server as a whole)."""
    return messages()[0](service=service).SerializeToString()  # type: ignore[no-any-return]


def status(response: bytes) -> HealthStatus:
    """The status in a serialized HealthCheckResponse."""
    return _STATUS.get(messages()[1].FromString(response).status, HealthStatus.UNKNOWN)
