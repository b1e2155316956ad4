"""Image routes: ``POST /v1/images/generations`` (JSON), ``/v1/images/edits`` and ``/v1/images/variations``
(``multipart/form-data``) (spec: ``openai-api.md``).

The model's sidecar decodes the uploads, makes the images and encodes them (:mod:`lemonkit.backends.images`); these
handlers check the request before anything loads (the fields, the model's type, that each upload is a PNG or JPEG by
its signature) and pass the sidecar's answer through. Only ``b64_json`` answers exist: lemonkit hosts no image URLs.
"""

from __future__ import annotations

from typing import Any

from lemonkit.backends.images.pictures import image_kind
from lemonkit.backends.protocol import Upload
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import InvalidArgument, InvalidRequest, MissingArgument, ModelNotApplicable
from lemonkit.formats import schemas
from lemonkit.server.openai import InferenceHandler, ModelRouteHandler
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["ImageEditHandler", "ImageGenerationHandler", "ImageVariationHandler", "form_fields"]

#: the fields the engines take, forwarded to the sidecar as they are
_ENGINE_FIELDS = ("prompt", "size", "n", "steps", "cfg_scale", "seed")
#: form fields that are JSON integers / numbers in the route's schema
_INTEGERS = frozenset({"n", "steps", "seed", "output_compression"})
_NUMBERS = frozenset({"cfg_scale"})
_FILE_FIELDS = frozenset({"image", "image[]", "mask"})


def _check_response_format(body: dict[str, Any]) -> None:
    if body.get("response_format") == "url":
        raise InvalidArgument(
            "response_format: 'url' is not supported (lemonkit hosts no image URLs); use 'b64_json', the default"
        )


def _engine_body(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in _ENGINE_FIELDS if body.get(key) is not None}


def form_fields(arguments: dict[str, list[bytes]]) -> dict[str, Any]:
    """A multipart form's text fields as the JSON body they stand for (integers and numbers parsed).

    Raises:
        InvalidArgument: A numeric field that does not parse.
    """
    body: dict[str, Any] = {}
    for name, values in arguments.items():
        if name in _FILE_FIELDS:
            continue
        text = values[-1].decode("utf-8", "replace").strip()
        if name in _INTEGERS or name in _NUMBERS:
            try:
                body[name] = int(text) if name in _INTEGERS else float(text)
            except ValueError:
                kind = "an integer" if name in _INTEGERS else "a number"
                raise InvalidArgument(f"{name}: expected {kind}, got {text!r}") from None
        else:
            body[name] = text
    return body


class _ImageRoute(ModelRouteHandler):
    """What the image routes share: image models only, and never an upscaler."""

    serves = ("image",)

    def check_applicable(self, info: ModelInfo) -> None:
        super().check_applicable(info)
        if "upscaling" in info.labels:
            raise ModelNotApplicable(f"{info.id} is an upscaling model; {self.request.path} needs an image model")

    async def relay(self, model: LoadedModel, body: dict[str, Any], files: list[Upload] | None = None) -> None:
        """The sidecar's answer as it is: megabytes of base64 PNGs are neither parsed nor re-encoded here."""
        response = await self.sidecar_request(model, self.sidecar_path, body, files=files)
        content = await self.sidecar_body(model, response)
        self.set_header("Content-Type", "application/json")
        self.finish(content)


class ImageGenerationHandler(_ImageRoute, InferenceHandler):
    """``POST /v1/images/generations``: images from a prompt."""

    schema = "images/generations"
    sidecar_path = "/v1/images/generations"

    def json_body(self, *, optional: bool = False) -> dict[str, Any]:
        body = super().json_body(optional=optional)
        _check_response_format(body)
        return body

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        await self.relay(model, _engine_body(body))


class ImageVariationHandler(_ImageRoute):
    """``POST /v1/images/variations``: images like an uploaded one (``multipart/form-data``)."""

    schema = "images/variations"
    sidecar_path = "/v1/images/variations"
    #: the route takes a ``mask`` part
    masks = False
    #: the route takes only multipart/form-data (no JSON form)
    multipart_only = True
    uploads: list[Upload]

    async def post(self) -> None:
        body = self.form_body()
        info = await self.service.usable(body["model"])
        self.check_applicable(info)
        await self.unless_gone(self._serve(info, body))

    def form_body(self) -> dict[str, Any]:
        """The checked fields; the uploads (images in order, then the mask) go to :attr:`uploads`.

        Raises:
            InvalidRequest: The body is not multipart/form-data.
            MissingArgument: No image.
            InvalidArgument: Files under both ``image`` and ``image[]``, an upload that is no PNG or JPEG, a field
                the schema refuses, ``response_format: url``.
        """
        if not self.request.headers.get("Content-Type", "").startswith("multipart/form-data"):
            raise InvalidRequest(
                f"{self.request.path} takes multipart/form-data with an 'image' part", code="invalid_content_type"
            )
        body = schemas.validate(self.schema or "", form_fields(self.request.body_arguments))
        _check_response_format(body)
        single, repeated = self._parts("image"), self._parts("image[]")
        if single and repeated:
            raise InvalidArgument("image: send the images under either 'image' or repeated 'image[]', not both")
        images = single or repeated
        if not images:
            raise MissingArgument("image: required argument is missing (a PNG or JPEG upload)")
        masks = self._parts("mask") if self.masks else []
        if len(masks) > 1:
            raise InvalidArgument("mask: send one mask")
        for field, upload in [*(("image", i) for i in images), *(("mask", m) for m in masks)]:
            if image_kind(upload.content) is None:
                raise InvalidArgument(f"{field}: {upload.filename!r} is not a PNG or JPEG image")
        self.uploads = [*images, *masks]
        return {**body, "has_mask": bool(masks)}

    def _parts(self, name: str) -> list[Upload]:
        parts = [
            Upload(p.filename or name, p.body, p.content_type or "application/octet-stream")
            for p in self.request.files.get(name, [])
        ]
        return parts + [Upload(name, raw) for raw in self.request.body_arguments.get(name, [])]

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        request = {**_engine_body(body), "has_mask": body["has_mask"]}
        await self.relay(model, request, self.uploads)


class ImageEditHandler(ImageVariationHandler):
    """``POST /v1/images/edits``: an uploaded image changed as a prompt says, where an optional mask is white."""

    schema = "images/edits"
    sidecar_path = "/v1/images/edits"
    masks = True
