"""The encoder's artefacts: what is built once and then served.

Package map:

- ``export``: the ONNX export of the dual encoder and the parity check gating every artefact.
- ``query_int8``: the int8 query tower beside an FP32 export, and its parity and quality
  gates (``up``'s default on CPU when they pass; ``--query-precision``).
- ``document_int8``: the same int8 graph serving documents, and its gates
  (``--document-precision``).
- ``int8_quality``: what both int8 gates share: the dev split, the quality result, the data.
- ``int8_record``: the quality gate's result recorded for fixed graphs (the default
  model's, ``query_int8_record.json``), for exports made where the data is not.
- ``int8_recheck``: an export's int8 graphs checked again where they are published
  (parity here, a quality result of these very graphs).
- ``parity_record``: an export's parity with its checkpoint, recorded (``parity.json``) so
  that a publish of the same bytes does not run the checkpoint in PyTorch again.
- ``tensorrt_build``: the TensorRT plan (FP16 with FP32 islands, FP32 fallback, the gate).
- ``onnx_fp16``: which ONNX nodes stay FP32 in an FP16 engine, and the FP16 cast.
- ``plan_meta``: a plan's ``<plan>.json`` and the atomic write of both.
- ``plan_cache``: plans cached per GPU and TensorRT release, refused elsewhere.
- ``repository``: the generated Triton model repository (``triton_models/``: its models).
"""
