"""Image engines: the ``diffusers`` recipe (:mod:`~lemonkit.backends.images.diffusers_engine`: text-to-image,
image-to-image variations and inpainting edits with Stable Diffusion pipelines) and what they share
(:mod:`~lemonkit.backends.images.params`: a request's checked settings; :mod:`~lemonkit.backends.images.pictures`:
decoding uploads and encoding answers with Pillow, in the sidecar).
"""
