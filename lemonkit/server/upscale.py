"""``POST /v1/images/upscale`` (spec: ``openai-api.md``): a base64 image and an ``upscaling`` model in, the
upscaled PNG out as ``{"created", "data": [{"b64_json"}], "output_format"}``.

The handler checks the request and the model before anything loads; the base64 is decoded off the event loop and
the image goes to the model's sidecar as an upload, where it is decoded, upscaled and encoded
(:mod:`lemonkit.backends.ncnn_upscale`). The sidecar's JSON answer is passed on as bytes, never parsed here.

Upscalers are ``on-demand`` models: they load on their first request, never through ``/v1/load``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from typing import Any

from lemonkit.backends.base import Upload
from lemonkit.errors import InvalidArgument, ModelNotApplicable
from lemonkit.manager import LoadedModel
from lemonkit.registry import ModelInfo
from lemonkit.server.openai import ModelRouteHandler

__all__ = ["UPSCALING_RECIPES", "UpscaleHandler", "decode_base64"]

#: recipes whose engine upscales
UPSCALING_RECIPES = ("ncnn",)
#: a data URL's head, which clients that read an image from a browser leave on
_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)


def decode_base64(text: str, *, what: str = "image") -> bytes:
    """The bytes of a base64 field (a ``data:image/...;base64,`` head is allowed; whitespace is ignored).

    Raises:
        InvalidArgument: Not base64, or empty.
    """
    text = _DATA_URL.sub("", text.strip(), count=1)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{what}: expected a base64-encoded image ({exc})") from None
    if not data:
        raise InvalidArgument(f"{what}: the image is empty")
    return data


class UpscaleHandler(ModelRouteHandler):
    """``POST /v1/images/upscale``."""

    schema = "images/upscale"
    sidecar_path = "/v1/images/upscale"
    serves = ("image",)

    async def post(self) -> None:
        body = self.json_body()
        image = await asyncio.to_thread(decode_base64, body["image"])
        upstream = {"model": body["model"], "upscale_factor": body.get("upscale_factor")}
        self._upload = Upload(filename="image", content=image)
        await self.serve_model(upstream)

    def check_applicable(self, info: ModelInfo) -> None:
        if "upscaling" not in info.labels:
            raise ModelNotApplicable(
                f"{info.id} is not an upscaling model (it has no 'upscaling' label); {self.request.path} needs one, "
                "such as RealESRGAN-x4plus"
            )
        if info.recipe not in UPSCALING_RECIPES:
            raise ModelNotApplicable(f"{info.id}'s recipe {info.recipe!r} cannot upscale")

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        response = await self.sidecar_request(model, self.sidecar_path, body, files=[self._upload])
        content = await self.sidecar_body(model, response)
        self.set_header("Content-Type", "application/json")
        self.finish(content)
