"""Distributed tracing (OpenTelemetry): the one owner of what is traced and how.

``config``
    :class:`~services.telemetry.config.TracingConfig`: the OTLP endpoint and the sample
    ratio, from a service's flags or the OpenTelemetry environment variables.
``tracing``
    the process's tracer (set up once by the entry point, off by default), the spans the
    code opens (:func:`~services.telemetry.tracing.span`), the W3C trace context read
    from a request (gRPC metadata, HTTP headers, a shard stream message) and written into
    the calls a process makes, and the exemplar a latency histogram records.
``spans``
    :class:`~services.telemetry.spans.Recorder` and its spans: how a span is recorded
    while tracing is on (the SDK's sampler, ids, limits and span processors, without the
    SDK's ``Tracer`` on the hot path).
``otlp``
    the OTLP/gRPC span exporter: the SDK's, with a cheaper encoding of the spans.

No grpc here: the gRPC server and clients (:mod:`services.rpc`, the index router, the
rerank and Triton clients) hand their metadata to these functions as plain pairs.
docs/tracing.md says what is traced and what it costs.
"""
