"""Serving the encoder on Triton, and the encoder versions of its model repository.

``triton_server``
    the Triton server process from the ``nvidia-pytriton`` wheel, without a container.
``versions``
    the repository's side of several versions of ``embed``: reading them, the publish
    lock, staging, an older repository's conversion, CPU budget files.
``publish``
    ``encoder publish``: a checkpoint becomes the next version of ``embed``.
``unpublish``
    ``encoder unpublish`` / ``index retire``: a version taken out again (whether one may
    be is decided by :mod:`services.generations.encoders`).
``triton_load``
    running Tritons load ``embed`` again, and a version is awaited there.
"""
