"""The GTR dual encoder: the model, its serving on Triton, its artefacts and its training.

``base``
    the :class:`Encoder` interface the rest of the service depends on, and its input checks.
``model``
    the dual encoder in PyTorch, loaded from a local sentence-transformers checkpoint.
``profiles``
    the size profiles (base … xxl) and how to pick one for a checkpoint.
``textcodec``
    text → token-id batches, shared by the in-process encoder and the Triton models.
``texts``
    the cut of a document's text to what the encoder reads.
``embeddings``
    a corpus and its queries encoded once and cached by model and content.
``runtime/``
    the encoder as the gateway calls it: in process, ONNX Runtime, or Triton's client.
``serve/``
    the Triton server process and the encoder versions of a model repository.
``build/``
    the artefacts Triton serves: ONNX export, TensorRT plan, model repository.
``train/``
    fine-tuning the encoder (Siamese or two towers) and comparing it with its base.
"""
