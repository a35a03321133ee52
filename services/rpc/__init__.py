"""The gRPC plumbing of every server and client of ours (the core packages never import it).

Servers
    ``server`` (``create_server(...) -> (server, port)``: health, reflection, admission,
    graceful stop), ``admission`` (the in-flight limit and a client's share of it),
    ``interceptors`` (their base), ``status`` (the one map from domain
    errors to gRPC codes), ``auth`` (bearer tokens), ``wire`` (fields sent with the wrong
    wire type), ``metrics`` (Prometheus, one injected registry per process),
    ``settings`` (the settings every service shares, and how they are loaded),
    ``event_loop`` (uvloop or the standard library's, the loop a server runs on).
Clients
    ``balance`` (over the servers behind one name), ``discovery`` (fixed addresses or a
    re-resolved DNS name), ``retry`` (gRPC's own retry policy on the channel).
Both
    ``tls`` (TLS and mutual TLS from PEM files), ``convert`` (protobuf ↔
    :mod:`services.common.domain` for ``common.proto``).
HTTP/JSON
    :mod:`.http/` (the gateway's RPCs over HTTP/JSON by the protos' ``google.api.http``
    rules, under the same admission, tokens, TLS, error map and metrics; the OpenAPI
    document).
"""
