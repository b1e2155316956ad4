"""The image panel: a prompt, a size, steps and a seed to a grid of images; pick one to edit, vary or upscale it.

As in every panel, the page never reaches the server: it asks the kernel, which calls :class:`lemonkit.Client`'s
image methods and sends the images back as PNG bytes (binary buffers, not base64 text).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar

import traitlets

from lemonkit.client import Client
from lemonkit.client.image_results import ImageInput, Images, image_bytes, open_image
from lemonkit.errors import InvalidRequest
from lemonkit.widgets.assets import esm
from lemonkit.widgets.panel import TaskPanel
from lemonkit.widgets.picker import choices

__all__ = ["ImagePanel"]

#: what the banner says when a picker has no model
_MISSING = {
    "model": "No image model is downloaded: pull one (lemonkit.ModelBrowser), such as SD-Turbo",
    "upscaler": "No upscaling model is available (the bundled Real-ESRGAN needs lemonkit[upscale])",
}


class ImagePanel(TaskPanel):
    """Generate images from a prompt (with a size, steps, a seed and how many), shown as a grid with each one's seed
    and settings; pick one to edit it with the prompt, make variations of it, or upscale it.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).
        model: The image model (default: a loaded one, else the first downloaded one).
        upscaler: The upscaling model (default: a loaded one, else the first downloaded one: the bundled
            Real-ESRGAN).
        prompt: The text the prompt box starts with.
        images: Images to show (and pick from) before any is generated: an
        :class:`~lemonkit.client.image_results.Images`, or
            PIL images, paths or bytes.

    Attributes:
        result: The :class:`~lemonkit.client.image_results.Images` the grid shows.
        history: Every result, oldest first.

    Example:
        >>> panel = lemonkit.ImagePanel(prompt="a lighthouse at dawn")
        >>> panel.generate().result().seeds
        [1714]
        >>> panel.upscale(0).result()[0].size
        (2048, 2048)
    """

    _esm = esm("image_panel")
    task = "image"
    upscalers = traitlets.List(traitlets.Unicode()).tag(sync=True)
    upscaler = traitlets.Unicode("").tag(sync=True)
    prompt = traitlets.Unicode("").tag(sync=True)
    #: ``WIDTHxHEIGHT``; ``""``: the model's own
    size = traitlets.Unicode("").tag(sync=True)
    #: inference steps; 0: the model's own
    steps = traitlets.Int(0).tag(sync=True)
    #: the seed; negative: a random one (each image's seed is in its caption)
    seed = traitlets.Int(-1).tag(sync=True)
    n = traitlets.Int(1).tag(sync=True)
    #: the grid: each image's PNG, and its caption
    images = traitlets.List(traitlets.Bytes()).tag(sync=True)
    captions = traitlets.List(traitlets.Unicode()).tag(sync=True)
    #: the picked image's index in the grid, -1 for none
    selected = traitlets.Int(-1).tag(sync=True)
    #: what is under way ("Generating", "Upscaling", ...), "" when idle
    activity = traitlets.Unicode("").tag(sync=True)
    actions: ClassVar[frozenset[str]] = frozenset({"generate", "edit", "vary", "upscale", "refresh_models", "dismiss"})
    page_fields: ClassVar[frozenset[str]] = frozenset({"prompt", "size", "steps", "seed", "n"})

    def __init__(
        self,
        *,
        client: Client | None = None,
        model: str | None = None,
        upscaler: str | None = None,
        prompt: str = "",
        images: Images | list[ImageInput] | None = None,
    ) -> None:
        self.result: Images | None = None
        self.history: list[Images] = []
        super().__init__(client=client, model=model, upscaler=upscaler or "", prompt=prompt)
        if images is not None:
            self.show(images)

    def read_models(self) -> None:
        super().read_models()
        upscalers, preferred = choices(self.client, "upscaling")
        self.upscalers = upscalers
        if not self.upscaler and preferred:
            self.upscaler = preferred

    def show(self, images: Images | list[ImageInput]) -> Images:
        """Put ``images`` in the grid (to pick from), as though the panel had made them."""
        if not isinstance(images, Images):
            images = Images([open_image(image_bytes(i)[0]) for i in images])
        self.result = images
        self.history.append(images)
        with self.hold_sync():
            self.images = [images.png(i) for i in range(len(images))]
            self.captions = [images.caption(i) for i in range(len(images))]
            self.selected = 0 if len(images) == 1 else -1
        return images

    def generate(self, prompt: str | None = None) -> Future[Images]:
        """Generate images from ``prompt`` (default: the prompt box's) with the panel's size, steps, seed and count;
        the future gives them.

        Raises:
            InvalidRequest: Work is under way or there is no prompt (the future's: no image model is available).
        """
        prompt = self._prompt(prompt)
        settings = {**self._settings(), "steps": self.steps or None}
        return self._run("Generating", lambda: self.client.generate_image(prompt, self.model, **settings))

    def edit(self, prompt: str | None = None, index: int | None = None) -> Future[Images]:
        """Edit the picked image (or image ``index``) as ``prompt`` (default: the prompt box's) describes.

        Raises:
            InvalidRequest: As :meth:`generate`, or no image is picked.
        """
        prompt, source = self._prompt(prompt), self._source(index)
        settings = {**self._settings(), "steps": self.steps or None}
        return self._run("Editing", lambda: self.client.edit_image(source, prompt, None, self.model, **settings))

    def vary(self, index: int | None = None) -> Future[Images]:
        """Variations of the picked image (or image ``index``).

        Raises:
            InvalidRequest: As :meth:`edit`.
        """
        source = self._source(index)
        return self._run("Varying", lambda: self.client.vary_image(source, self.model, **self._settings()))

    def upscale(self, index: int | None = None) -> Future[Images]:
        """Upscale the picked image (or image ``index``) with the chosen upscaler.

        Raises:
            InvalidRequest: Work is under way or no image is picked (the future's: no upscaler is available).
        """
        source = self._source(index)
        return self._run("Upscaling", lambda: self.client.upscale(source, self.upscaler), needs="upscaler")

    def _prompt(self, prompt: str | None) -> str:
        if prompt is not None:
            self.prompt = str(prompt)
        if not self.prompt.strip():
            raise InvalidRequest("There is no prompt")
        return self.prompt

    def _source(self, index: int | None) -> Any:
        index = self.selected if index is None else int(index)
        if self.result is None or not 0 <= index < len(self.result):
            raise InvalidRequest("Pick an image first")
        self.selected = index
        return self.result[index]

    def _settings(self) -> dict[str, Any]:
        return {"n": self.n, "size": self.size.strip() or None, "seed": self.seed}

    def _run(self, activity: str, call: Callable[[], Images], *, needs: str = "model") -> Future[Images]:
        """Run ``call`` in the background once the pickers were first read (a click right after the panel showed may
        come before), showing its images; ``needs`` names the picker that must have a model."""
        self._start(needs_model=False)
        self.activity = activity

        def run() -> Images:
            try:
                self.ready.result()
                if not getattr(self, needs):
                    raise InvalidRequest(_MISSING[needs])
                return self.show(call())
            finally:
                with self.hold_sync():
                    self.activity = ""
                    self.busy = False

        return self.background(run)
