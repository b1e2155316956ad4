"""The image calls of both clients (:class:`ImageCalls`): generate_image, edit_image, vary_image, upscale, each
written once as steps (see :mod:`lemonkit.client.calls`).

Building each request and reading its answer are :class:`ImageRequest`'s. The module functions
(``lemonkit.generate_image``, ...) run the calls on the shared default client.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

from lemonkit.catalog import config
from lemonkit.client.calls import Steps, call, traced
from lemonkit.client.image_results import ImageInput, Images, image_bytes, png_bytes
from lemonkit.errors import InvalidArgument

__all__ = ["ImageCalls", "ImageRequest", "Size", "size_of"]

#: ``"512x512"`` or ``(512, 512)``
Size = str | tuple[int, int]


def size_of(size: Size | None) -> str | None:
    """``size`` as the API's ``WIDTHxHEIGHT``.

    Raises:
        InvalidArgument: Not ``WxH`` or a ``(width, height)`` pair of positive integers.
    """
    if size is None:
        return None
    if isinstance(size, str):
        width, _, height = size.lower().partition("x")
        if width.strip().isdigit() and height.strip().isdigit():
            return f"{int(width)}x{int(height)}"
    elif isinstance(size, tuple | list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size):
        return f"{size[0]}x{size[1]}"
    raise InvalidArgument(f"size must be 'WIDTHxHEIGHT' or (width, height), not {size!r}")


def _options(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _seeded(seed: int | None) -> int:
    """A seed when the caller named none, so that every image can be made again (it is in its settings)."""
    return secrets.randbelow(2**31) if seed is None or seed < 0 else int(seed)


@dataclass
class ImageRequest:
    """One image request: its route, its JSON body or form fields and files, and what each image was asked with."""

    route: str
    fields: dict[str, Any]
    files: list[tuple[str, tuple[str, bytes, str]]] = field(default_factory=list, repr=False)

    @classmethod
    def generation(cls, prompt: str, model: str, *, n: int, size: Size | None, **settings: Any) -> ImageRequest:
        """``/v1/images/generations`` (JSON)."""
        seed = _seeded(settings.pop("seed", None))
        body = {"model": model, "prompt": prompt, "n": n, "response_format": "b64_json", "seed": seed}
        return cls("images/generations", {**body, **_options(size=size_of(size), **settings)})

    @classmethod
    def edit(
        cls, image: ImageInput | list[ImageInput], prompt: str, model: str, *, mask: ImageInput | None, **kw: Any
    ) -> ImageRequest:
        """``/v1/images/edits`` (multipart): one ``image``, or several as ``image[]`` in order, and a ``mask``."""
        images = image if isinstance(image, list) else [image]
        if not images:
            raise InvalidArgument("edit_image needs at least one image")
        name = "image[]" if len(images) > 1 else "image"
        files = [_upload(name, source, f"image-{i}") for i, source in enumerate(images)]
        if mask is not None:
            files.append(("mask", ("mask.png", png_bytes(mask), "image/png")))
        return cls("images/edits", cls._form(model, prompt=prompt, **kw), files)

    @classmethod
    def variation(cls, image: ImageInput, model: str, **kw: Any) -> ImageRequest:
        """``/v1/images/variations`` (multipart)."""
        return cls("images/variations", cls._form(model, **kw), [_upload("image", image, "image")])

    @classmethod
    def upscale(cls, image: ImageInput, model: str, *, factor: int | None) -> ImageRequest:
        """``/v1/images/upscale`` (JSON, the image as base64 PNG)."""
        encoded = base64.b64encode(png_bytes(image)).decode("ascii")
        return cls("images/upscale", {"model": model, "image": encoded, **_options(upscale_factor=factor)})

    @staticmethod
    def _form(model: str, *, n: int, size: Size | None, seed: int | None, **settings: Any) -> dict[str, Any]:
        body = {"model": model, "n": n, "response_format": "b64_json", "seed": _seeded(seed)}
        return {**body, **_options(size=size_of(size), **settings)}

    @property
    def kwargs(self) -> dict[str, Any]:
        """The ``request()`` arguments that send it."""
        if not self.files:
            return {"json": self.fields}
        return {"data": {k: str(v) for k, v in self.fields.items()}, "files": self.files}

    def sent(self) -> Steps[Images]:
        """Send it; the answer as :class:`~lemonkit.client.image_results.Images`, with this request's provenance
        (image data left out)."""
        body = {k: v for k, v in self.fields.items() if k != "image"}
        if self.files:
            body["files"] = [f"{name}={file[0]}" for name, file in self.files]
        answer, facts = yield from traced(self.route, body, **self.kwargs)
        asked = {k: v for k, v in self.fields.items() if k in ("seed", "steps", "cfg_scale", "upscale_factor")}
        prompt = self.fields.get("prompt")
        return Images.from_answer(answer, model=self.fields["model"], prompt=prompt, provenance=facts, defaults=asked)


def _upload(name: str, source: ImageInput, stem: str) -> tuple[str, tuple[str, bytes, str]]:
    data, media_type = image_bytes(source)
    return name, (f"{stem}.{media_type.rsplit('/', 1)[1]}", data, media_type)


class ImageCalls:
    """Mixed into both clients."""

    @call
    def generate_image(
        self,
        prompt: str,
        model: str | None = None,
        *,
        n: int = 1,
        size: Size | None = None,
        steps: int | None = None,
        cfg_scale: float | None = None,
        seed: int | None = None,
    ) -> Steps[Images]:
        """Generate images from a text prompt; in a notebook they show as a grid, each with its seed and settings.

        Args:
            prompt: What to draw.
            model: An image model; ``None``: ``lemonkit.catalog.config.default_image_model()`` (``SD-Turbo``,
                downloaded on first use; ``LEMONKIT_DEFAULT_IMAGE_MODEL`` overrides it).
            n: How many images.
            size: ``"WIDTHxHEIGHT"`` or ``(width, height)``; ``None``: the model's own, else 512x512.
            steps: Inference steps (``None``: the model's own).
            cfg_scale: Classifier-free guidance scale (``None``: the model's own).
            seed: The seed; ``None`` or negative: a random one. Each image's seed (as the engine reports it) is in
                its settings, so that it can be made again.

        Returns:
            :class:`~lemonkit.client.image_results.Images`: a list of PIL images with ``.settings``, ``.seeds``,
            ``.save(dir)`` and ``provenance``.

        Raises:
            InvalidArgument: A size the model cannot make, or another bad argument.
            ModelNotApplicable: ``model`` does not generate images.
            ModelNotFound: ``model`` is not registered.
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> images = lemonkit.Client().generate_image("a lighthouse at dawn", n=2, steps=2, seed=7)
            >>> images.seeds, images[0].size
            ([7, 8], (512, 512))
        """
        model = model or config.default_image_model()
        request = ImageRequest.generation(prompt, model, n=n, size=size, steps=steps, cfg_scale=cfg_scale, seed=seed)
        return (yield from request.sent())

    @call
    def edit_image(
        self,
        image: ImageInput | list[ImageInput],
        prompt: str,
        mask: ImageInput | None = None,
        model: str | None = None,
        *,
        n: int = 1,
        size: Size | None = None,
        steps: int | None = None,
        cfg_scale: float | None = None,
        seed: int | None = None,
    ) -> Steps[Images]:
        """Edit an image as ``prompt`` describes; with a ``mask``, only its white part is redrawn (inpainting).

        Args:
            image: A PIL image, a PNG or JPEG file's path, or its bytes; a list for several references, in order.
            prompt: The edit.
            mask: The same kinds as ``image``: white is edited, black is kept.
            model: As :meth:`generate_image`'s.
            n: How many images (1 to 10).
            size: As :meth:`generate_image`'s; ``None``: the first image's size (scaled down under the model's
                pixel cap).
            steps: As :meth:`generate_image`'s.
            cfg_scale: As :meth:`generate_image`'s.
            seed: As :meth:`generate_image`'s.

        Returns:
            :class:`~lemonkit.client.image_results.Images`, as :meth:`generate_image`.

        Raises:
            InvalidArgument: ``image`` or ``mask`` is not an image, or another bad argument.
            LemonkitError: As :meth:`generate_image`.

        Example:
            >>> edited = lemonkit.Client().edit_image(photo, "a red barn", mask=barn_mask, seed=1)
            >>> edited[0].size == photo.size
            True
        """
        model = model or config.default_image_model()
        request = ImageRequest.edit(
            image, prompt, model, mask=mask, n=n, size=size, steps=steps, cfg_scale=cfg_scale, seed=seed
        )
        return (yield from request.sent())

    @call
    def vary_image(
        self,
        image: ImageInput,
        model: str | None = None,
        *,
        n: int = 1,
        size: Size | None = None,
        seed: int | None = None,
    ) -> Steps[Images]:
        """Variations of an image.

        Args:
            image: As :meth:`edit_image`'s (one image).
            model: As :meth:`generate_image`'s.
            n: How many variations (1 to 10).
            size: As :meth:`generate_image`'s.
            seed: As :meth:`generate_image`'s.

        Returns:
            :class:`~lemonkit.client.image_results.Images`, as :meth:`generate_image` (``prompt`` is ``None``).

        Raises:
            LemonkitError: As :meth:`edit_image`.

        Example:
            >>> len(lemonkit.Client().vary_image("cat.png", n=3))
            3
        """
        model = model or config.default_image_model()
        return (yield from ImageRequest.variation(image, model, n=n, size=size, seed=seed).sent())

    @call
    def upscale(self, image: ImageInput, model: str | None = None, *, factor: int | None = None) -> Steps[Images]:
        """Upscale an image (Real-ESRGAN: 4x by default, bundled, offline).

        Args:
            image: As :meth:`edit_image`'s (one image; sent as PNG).
            model: An upscaling model; ``None``: ``lemonkit.catalog.config.default_upscale_model()``
                (``RealESRGAN-x4plus``, bundled; ``LEMONKIT_DEFAULT_UPSCALE_MODEL`` overrides it).
            factor: The scale, where the model allows one (``None``: the model's own).

        Returns:
            :class:`~lemonkit.client.image_results.Images` holding the one upscaled image (``result[0]``).

        Raises:
            ModelNotApplicable: ``model`` is not an upscaling model.
            LemonkitError: As :meth:`edit_image`.

        Example:
            >>> lemonkit.Client().upscale(small)[0].size
            (512, 512)
        """
        model = model or config.default_upscale_model()
        return (yield from ImageRequest.upscale(image, model, factor=factor).sent())
