"""The ``diffusers`` recipe's engine: a Stable Diffusion pipeline (SD 1.x/2.x, SD-Turbo, SDXL, SDXL-Turbo) on the CPU.

The model is a directory in diffusers layout (``model_index.json`` and one folder per component), as the Hugging
Face repos of Lemonade's ``SD-Turbo``, ``SDXL-Turbo``, ``SD-1.5`` and ``SDXL-Base-1.0`` hold it next to their
single-file checkpoints. Three calls (see :mod:`lemonkit.backends.protocol`): :meth:`DiffusersEngine.generate`
(text-to-image), :meth:`~DiffusersEngine.edit` (inpainting where a mask is white; without a mask, image-to-image
guided by the prompt) and :meth:`~DiffusersEngine.vary` (image-to-image without a prompt). The image-to-image and
inpainting pipelines share the text-to-image pipeline's weights (``from_pipe``), so they cost no memory. Images
are made one at a time, each from its own seed, so image ``i`` of a request with seed ``s`` is the image a request
with seed ``s + i`` makes first; a client that leaves stops the work at the next denoising step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lemonkit.backends.engine_devices import torch_device
from lemonkit.backends.images.params import SOFT_PIXEL_CAP, Settings, capped_size
from lemonkit.backends.images.pictures import decode_image, encode_png
from lemonkit.backends.protocol import Cancelled, LoadSpec, Upload, thread_count
from lemonkit.errors import InvalidArgument, MissingArgument, ModelLoadError

__all__ = ["DiffusersEngine"]

#: how far an edit without a mask moves from its image (1.0 would ignore the image)
EDIT_STRENGTH = 0.8
#: how far a variation moves from its image: the composition stays, the details change
VARIATION_STRENGTH = 0.6
#: weight files of a component folder a pipeline may load, in the order they are preferred
_WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors")


def _variant(root: Path, components: list[str]) -> str | None:
    """``"fp16"`` when some component has only fp16 weights (the downloader takes those when a repo offers them)."""
    for name in components:
        folder = root / name
        if not folder.is_dir():
            continue
        files = {p.name for p in folder.iterdir()}
        has_plain = any(w in files for w in _WEIGHTS) or any(".safetensors.index.json" in f for f in files)
        if not has_plain and any(".fp16." in f for f in files):
            return "fp16"
    return None


def _prompt(body: dict[str, Any], *, required: bool) -> str:
    prompt = body.get("prompt")
    if prompt is None and not required:
        return ""
    if not isinstance(prompt, str) or (required and not prompt.strip()):
        raise MissingArgument("prompt: required argument is missing (the text of the image to make)")
    return prompt


class DiffusersEngine:
    """A diffusers text-to-image pipeline and the image-to-image and inpainting pipelines made from it."""

    def __init__(self, spec: LoadSpec) -> None:
        """Load the pipeline in ``spec["model_path"]``.

        Args:
            spec: ``model_path`` (the diffusers-layout directory), ``type`` (must be ``image``), optional
                ``options`` (``steps``, ``cfg_scale``, ``width``, ``height``, ``soft_pixel_cap``, ``n_threads``).

        Raises:
            ModelLoadError: Not an image model, no diffusers layout, or diffusers cannot load it.
        """
        import diffusers
        import torch
        from diffusers import AutoPipelineForText2Image

        if spec.get("type") != "image":
            raise ModelLoadError(f"lemonkit's diffusers engine serves image models, not {spec.get('type')!r}")
        root = Path(spec["model_path"])
        index_file = root / "model_index.json"
        if not index_file.is_file():
            raise ModelLoadError(f"{root} is not a diffusers pipeline (it has no model_index.json)")
        diffusers.utils.logging.disable_progress_bar()  # the sidecar's log is no terminal
        self._options = dict(spec.get("options") or {})
        threads = thread_count(self._options)
        torch.set_num_threads(int(threads))
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
            components = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)]
            # float32 on the CPU, whatever the files hold (fp16 weights are upcast as they load); half precision on
            # a GPU, where it is the fast path
            self._placed = torch_device(torch)
            kwargs: dict[str, Any] = {"dtype": getattr(torch, self._placed.dtype), "local_files_only": True}
            variant = _variant(root, components)
            if variant:
                kwargs["variant"] = variant
            if "safety_checker" in index:  # the downloader leaves the NSFW classifier out (1.2 GB of weights)
                kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
            pipe = AutoPipelineForText2Image.from_pretrained(str(root), **kwargs)
        except Exception as exc:  # diffusers raises OSError/ValueError/KeyError/... for missing or foreign files
            raise ModelLoadError(f"diffusers could not load {root}: {exc}") from exc
        pipe.set_progress_bar_config(disable=True)
        if self._placed.device != "cpu":
            pipe.to(self._placed.device)
        self._text2image = pipe
        self._pipes: dict[str, Any] = {}
        self._multiple = int(getattr(pipe, "vae_scale_factor", 8))
        self._threads = int(threads)
        self._stats: dict[str, Any] = {}
        self._fingerprint = f"diffusers-{diffusers.__version__}+torch-{torch.__version__}"

    # -- the three calls -----------------------------------------------------------------------------------------

    def generate(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any]:
        """``/v1/images/generations``: ``n`` images of ``prompt``.

        Args:
            body: ``prompt``; optional ``size``, ``n``, ``steps``, ``cfg_scale``, ``seed``.
            cancelled: True once the client has left.

        Returns:
            ``{"created", "data": [{"b64_json", "generation_info"}], "output_format": "png"}``.

        Raises:
            MissingArgument, InvalidArgument: A missing prompt, or a setting out of range.
        """
        settings = Settings.parse(body, self._options, multiple=self._multiple)
        prompt = _prompt(body, required=True)
        pipe = self._text2image

        def make(generator: Any, stop: Any) -> Any:
            return pipe(
                prompt=prompt,
                width=settings.width,
                height=settings.height,
                num_inference_steps=settings.steps,
                guidance_scale=settings.cfg_scale,
                generator=generator,
                callback_on_step_end=stop,
            ).images[0]

        return self._images(settings, prompt, make, cancelled, {})

    def edit(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any]:
        """``/v1/images/edits``: the image changed as ``prompt`` says, where the mask is white (everywhere without).

        Args:
            body: ``files`` (the image, then the mask when ``has_mask``), ``prompt``; optional ``size`` (default: the
                image's, scaled down under ``soft_pixel_cap``), ``n``, ``steps``, ``cfg_scale``, ``seed``.
            cancelled: True once the client has left.

        Returns:
            As :meth:`generate`; ``generation_info`` adds ``strength`` and ``masked``.

        Raises:
            MissingArgument, InvalidArgument: No image or prompt, an undecodable upload, a setting out of range.
        """
        files: list[Upload] = body.get("files") or []
        has_mask = bool(body.get("has_mask"))
        images = files[:-1] if has_mask else files
        if not images:
            raise MissingArgument("image: required argument is missing (the PNG or JPEG to edit)")
        if len(images) > 1:
            raise InvalidArgument(f"image: this model edits one image at a time, got {len(images)}")
        source = decode_image(images[0], field="image")
        mask = decode_image(files[-1], field="mask", mode="L") if has_mask else None
        cap = int(self._options.get("soft_pixel_cap") or SOFT_PIXEL_CAP)
        default = capped_size(source.width, source.height, cap=cap, multiple=self._multiple)
        settings = Settings.parse(body, self._options, multiple=self._multiple, size=default)
        prompt = _prompt(body, required=True)
        size = (settings.width, settings.height)
        source = source.resize(size)
        if mask is None:
            make = self._image2image(prompt, source, settings, EDIT_STRENGTH)
            return self._images(settings, prompt, make, cancelled, {"strength": EDIT_STRENGTH, "masked": False})
        mask = mask.resize(size)
        inpaint = self._pipe("inpaint")

        def paint(generator: Any, stop: Any) -> Any:
            from PIL import Image

            painted = inpaint(
                prompt=prompt,
                image=source,
                mask_image=mask,
                width=settings.width,
                height=settings.height,
                strength=1.0,
                num_inference_steps=settings.steps,
                guidance_scale=settings.cfg_scale,
                generator=generator,
                callback_on_step_end=stop,
            ).images[0]
            # the VAE's round trip blurs what the mask keeps: paste the kept pixels back as they were
            return Image.composite(painted.resize(size), source, mask)

        return self._images(settings, prompt, paint, cancelled, {"strength": 1.0, "masked": True})

    def vary(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any]:
        """``/v1/images/variations``: images like ``files[0]`` (image-to-image without a prompt).

        Args:
            body: ``files`` (the source image); optional ``size`` (default: the model's), ``n``, ``seed``, ``steps``,
                ``cfg_scale``.
            cancelled: True once the client has left.

        Returns:
            As :meth:`generate`; ``generation_info`` adds ``strength``.

        Raises:
            MissingArgument, InvalidArgument: No image, an undecodable upload, a setting out of range.
        """
        files: list[Upload] = body.get("files") or []
        if not files:
            raise MissingArgument("image: required argument is missing (the PNG or JPEG to vary)")
        if len(files) > 1:
            raise InvalidArgument(f"image: this model varies one image at a time, got {len(files)}")
        source = decode_image(files[0], field="image")
        settings = Settings.parse(body, self._options, multiple=self._multiple)
        source = source.resize((settings.width, settings.height))
        make = self._image2image("", source, settings, VARIATION_STRENGTH)
        return self._images(settings, "", make, cancelled, {"strength": VARIATION_STRENGTH})

    # -- shared --------------------------------------------------------------------------------------------------

    def _pipe(self, kind: str) -> Any:
        """The ``image2image`` or ``inpaint`` pipeline on the text-to-image pipeline's components, made once."""
        if kind not in self._pipes:
            from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

            factory = AutoPipelineForInpainting if kind == "inpaint" else AutoPipelineForImage2Image
            pipe = factory.from_pipe(self._text2image)
            pipe.set_progress_bar_config(disable=True)
            self._pipes[kind] = pipe
        return self._pipes[kind]

    def _image2image(self, prompt: str, source: Any, settings: Settings, strength: float) -> Callable[..., Any]:
        pipe = self._pipe("image2image")
        # image-to-image runs steps x strength steps: at least one
        steps = max(settings.steps, math.ceil(1 / strength))

        def make(generator: Any, stop: Any) -> Any:
            return pipe(
                prompt=prompt,
                image=source,
                strength=strength,
                num_inference_steps=steps,
                guidance_scale=settings.cfg_scale,
                generator=generator,
                callback_on_step_end=stop,
            ).images[0]

        return make

    def _images(
        self,
        settings: Settings,
        prompt: str,
        make: Callable[[Any, Any], Any],
        cancelled: Cancelled,
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """Run ``make(generator, step_callback)`` once per seed and encode each image."""
        import torch

        def stop(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if cancelled():
                pipe._interrupt = True  # diffusers' pipelines skip their remaining steps when it is set
            return tensors

        start = time.perf_counter()
        data = []
        for seed in settings.seeds():
            if cancelled():
                break
            picture = make(torch.Generator("cpu").manual_seed(seed), stop)
            info = settings.info(seed, **extra)
            parameters = f"{prompt}\nSteps: {settings.steps}, CFG scale: {settings.cfg_scale}, Seed: {seed}, " + (
                f"Size: {settings.width}x{settings.height}"
            )
            data.append({"b64_json": encode_png(picture, parameters), "generation_info": info})
        seconds = time.perf_counter() - start
        self._stats = {
            "images": len(data),
            "width": settings.width,
            "height": settings.height,
            "steps": settings.steps,
            "seconds_per_image": round(seconds / len(data), 4) if data else None,
            "wall_ms": round(seconds * 1000, 3),
        }
        return {"created": int(time.time()), "data": data, "output_format": "png"}

    # -- the engine protocol -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The last request's image count, size, steps and time."""
        return dict(self._stats)

    def info(self) -> dict[str, Any]:
        """The pipeline class, device, threads and the size multiple."""
        return {
            "device": "cpu" if self._placed.device == "cpu" else "gpu",
            "torch_device": self._placed.device,
            "n_threads": self._threads,
            "pipeline": type(self._text2image).__name__,
            "size_multiple": self._multiple,
            "engine": self._fingerprint,
        }

    def close(self) -> None:
        self._pipes.clear()
