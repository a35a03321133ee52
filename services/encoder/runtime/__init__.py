"""The encoder behind :class:`services.encoder.base.Encoder`, as a process calls it.

``inprocess``
    the PyTorch model in this process (embedded mode, tests, benchmarks).
``onnx_embedder``
    the ONNX export run with ONNX Runtime in this process: the CPU serving path's core.
``triton_client``
    a client of Triton's ``embed`` model (KServe v2 over gRPC, asyncio).
"""
