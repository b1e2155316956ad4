"""``POST /v1/images/upscale`` (spec: ``openai-api.md``): a base64 image and an ``upscaling`` model in, the
upscaled PNG out as ``{"created", "data": [{"b64_json"}], "output_format"}``.

The handler checks the request and the model before anything loads; the base64 is decoded off the event loop and
the image goes to the model's sidecar as an upload, where it is decoded, upscaled and encoded
(:mod:`lemonkit.backends.ncnn_upscale`). The sidecar's JSON answer is passed on as bytes, never parsed here.

Upscalers are ``on-demand`` models: they load on their first request, never through ``/v1/load``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lemonkit.backends.protocol import Upload
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import ModelNotApplicable
from lemonkit.formats.bodies import decode_base64
from lemonkit.server.openai import ModelRouteHandler
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["UPSCALING_RECIPES", "UpscaleHandler", "decode_base64"]

#: recipes whose engine upscales
UPSCALING_RECIPES = ("ncnn",)


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
