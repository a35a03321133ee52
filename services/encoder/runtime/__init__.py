"""The encoder behind :class:`services.encoder.base.Encoder`, as a process calls it.

``inprocess``
    the PyTorch model in this process (embedded mode, tests, benchmarks).
``local_queries``
    queries embedded in this process by the graph of the version Triton serves (read from
    its CPU model repository), documents through Triton: the local stack's gateway.
``onnx_embedder``
    the ONNX export run with ONNX Runtime in this process: the CPU serving path's core.
``triton_client``
    a client of Triton's ``embed`` model (KServe v2 over gRPC, asyncio).
"""
