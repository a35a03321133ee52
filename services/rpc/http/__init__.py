"""HTTP/JSON beside gRPC: the gateway's RPCs transcoded by their ``google.api.http`` rules
(docs/http.md).

``rules`` (the route table read from the protos' annotations, path templates, which
fields a query string may set), ``transcode`` (an HTTP request as the request message,
a reply as canonical JSON), ``server`` (the aiohttp server that calls the servicers
under the gRPC port's admission, tokens, deadline, error map and metrics), ``openapi``
(the OpenAPI document generated from the same rules and messages, for
``scripts/gen_protos.py``).
"""
