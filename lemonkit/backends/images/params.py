"""An image request's settings, checked against the model's defaults: size, count, steps, guidance and seeds.

Defaults come from the load options (the row's ``image_defaults``, saved or requested ``steps``, ``cfg_scale``,
``width``, ``height``), else Lemonade's: 512x512, 20 steps, guidance 7.0. A seed that is absent or negative is
drawn at random and reported, so any image can be made again.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = [
    "DEFAULT_SIZE",
    "MAX_IMAGES",
    "MAX_SIDE",
    "SOFT_PIXEL_CAP",
    "Settings",
    "capped_size",
    "parse_size",
]

DEFAULT_SIZE = (512, 512)
DEFAULT_STEPS = 20
DEFAULT_CFG_SCALE = 7.0
#: ``n`` may ask for this many images at most (OpenAI's limit)
MAX_IMAGES = 10
#: the largest side the engine makes (a CPU pipeline at 2048x2048 already takes many minutes per image)
MAX_SIDE = 2048
#: an edit without ``size`` keeps its image's size scaled down to at most this many pixels (the spec's default)
SOFT_PIXEL_CAP = 2048 * 2048
#: seeds are drawn from [0, 2**32) (what torch generators and sd.cpp accept alike)
SEED_RANGE = 2**32
_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


def parse_size(value: object, *, multiple: int) -> tuple[int, int]:
    """``"WxH"`` as ``(width, height)``, each side a multiple of ``multiple`` from ``multiple`` to :data:`MAX_SIDE`.

    Raises:
        InvalidArgument: Not ``WIDTHxHEIGHT``, or a size the engine cannot make.
    """
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidArgument(f"size: expected WIDTHxHEIGHT such as 512x512, got {value!r}")
    width, height = int(match[1]), int(match[2])
    for side in (width, height):
        if side % multiple or not multiple <= side <= MAX_SIDE:
            raise InvalidArgument(
                f"size: {width}x{height} cannot be made; each side must be a multiple of {multiple} "
                f"from {multiple} to {MAX_SIDE}"
            )
    return width, height


def capped_size(width: int, height: int, *, cap: int, multiple: int) -> tuple[int, int]:
    """An image's size scaled down (keeping its aspect) to at most ``cap`` pixels, each side rounded down to a
    multiple of ``multiple`` and kept within :data:`MAX_SIDE`: the default output size of an edit."""
    scale = min(1.0, math.sqrt(cap / (width * height)), MAX_SIDE / max(width, height))
    return tuple(max(multiple, int(side * scale) // multiple * multiple) for side in (width, height))  # type: ignore[return-value]


def _number(body: dict[str, Any], name: str, *, integer: bool) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise InvalidArgument(f"{name}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class Settings:
    """What one request makes: ``n`` images of ``width`` x ``height`` in ``steps`` steps, image ``i`` from seed
    ``seed + i``."""

    width: int
    height: int
    n: int
    steps: int
    cfg_scale: float
    seed: int

    @classmethod
    def parse(
        cls, body: dict[str, Any], options: dict[str, Any], *, multiple: int, size: tuple[int, int] | None = None
    ) -> Settings:
        """The settings of ``body`` over the model's ``options``.

        Args:
            body: ``size``, ``n``, ``steps``, ``cfg_scale``, ``seed`` (each optional).
            options: The load options (``width``, ``height``, ``steps``, ``cfg_scale`` defaults).
            multiple: What each side must be a multiple of (the pipeline's latent scale).
            size: The size when ``body`` names none (an edit's image size), else the model's default.

        Raises:
            InvalidArgument: A value out of range or of the wrong type.
        """
        if body.get("size") not in (None, "", "auto"):
            width, height = parse_size(body["size"], multiple=multiple)
        elif size is not None:
            width, height = size
        else:
            width = int(options.get("width") or DEFAULT_SIZE[0])
            height = int(options.get("height") or DEFAULT_SIZE[1])
        n = _number(body, "n", integer=True)
        n = 1 if n is None else n
        if not 1 <= n <= MAX_IMAGES:
            raise InvalidArgument(f"n: expected 1 to {MAX_IMAGES} images, got {n}")
        steps = _number(body, "steps", integer=True)
        if steps is None:
            steps = options.get("steps") or DEFAULT_STEPS
        if not 1 <= steps <= 1000:
            raise InvalidArgument(f"steps: expected 1 to 1000, got {steps}")
        cfg_scale = _number(body, "cfg_scale", integer=False)
        if cfg_scale is None:
            cfg_scale = options.get("cfg_scale", DEFAULT_CFG_SCALE)
        if not 0 <= float(cfg_scale) <= 100:
            raise InvalidArgument(f"cfg_scale: expected 0 to 100, got {cfg_scale}")
        seed = _number(body, "seed", integer=True)
        if seed is None or seed < 0:
            seed = secrets.randbelow(SEED_RANGE)
        return cls(width, height, int(n), int(steps), float(cfg_scale), int(seed) % SEED_RANGE)

    def seeds(self) -> list[int]:
        """Each image's seed."""
        return [(self.seed + i) % SEED_RANGE for i in range(self.n)]

    def info(self, seed: int, **extra: Any) -> dict[str, Any]:
        """One image's ``generation_info``."""
        return {
            "seed": seed,
            "steps": self.steps,
            "cfg_scale": self.cfg_scale,
            "width": self.width,
            "height": self.height,
            **extra,
        }
