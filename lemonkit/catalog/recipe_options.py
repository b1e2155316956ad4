"""Recipe options: which ones a recipe takes, their defaults, how they resolve, and how a saved change is checked.

Loading a model (``/v1/load`` or a first request) and the per-model options routes (``/v1/models/{id}/options``)
resolve through the same :func:`resolve_options`, so the ``effective`` those routes report is what the next load
uses. The chain, lowest first: lemonkit's defaults < the server's settings (environment, flags, traitlets) < the
model's registry row (``recipe_options``) < its ``recipe_options.json`` entry ("saved") < the load request.

At every layer ``null`` means "not set here", and so do ``-1``, ``""`` and ``"auto"`` for every option but
``ctx_size``, where ``-1`` is a value: size the context automatically, even over a server-wide number, and the
boolean ``merge_args``, which only ``null`` unsets.

Flag strings (``llamacpp_args``) are the exception to "the higher layer wins": with ``merge_args`` true (the
default) the model's string, from the highest per-model layer that sets one, is merged flag by flag over the
server's (:func:`lemonkit.formats.llamacpp_args.merge_llamacpp_args`); with ``merge_args`` false it replaces it.

Nothing here imports an inference library: the engine imports :func:`llamacpp_context_size` from here so the
server can predict the context a load will get (``resolved_ctx_size``) by the engine's own rule, and both read
flag strings with :mod:`lemonkit.formats.llamacpp_args`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lemonkit.errors import InvalidArgument
from lemonkit.formats import schemas
from lemonkit.formats.llamacpp_args import merge_llamacpp_args, parse_llamacpp_args

if TYPE_CHECKING:
    from lemonkit.catalog.config import Settings
    from lemonkit.catalog.registry import ModelInfo

__all__ = [
    "AUTO_CTX_SIZE",
    "DEFAULT_CTX_SIZE",
    "DEFAULT_DRAFT_MAX",
    "DEFAULT_N_BATCH",
    "DEFAULT_N_PARALLEL",
    "MTP_DRAFT_MAX",
    "RECIPE_DEFAULTS",
    "RECIPE_OPTIONS",
    "ResolvedOptions",
    "apply_changes",
    "check_runnable",
    "draft_context",
    "drafts_with_head",
    "is_unset",
    "llamacpp_context_size",
    "load_body",
    "parse_changes",
    "resolve_options",
    "resolved_ctx_size",
    "rollback_tokens",
]

#: ``ctx_size`` meaning "size it from the model"
AUTO_CTX_SIZE = -1
#: the cap on an automatic context: trained contexts of 32k-128k would cost GBs of KV cache per loaded model;
#: 4096 is also Lemonade's default
DEFAULT_CTX_SIZE = 4096
#: llama.cpp pads the context to a multiple of this
_CTX_PAD = 256
#: Prompt batch: llama-server's physical batch size; larger buys nothing on CPU.
DEFAULT_N_BATCH = 512
#: Requests generated together (``--parallel``), llama-server's default: measured on Gemma 3 270M, 2 threads
#: (see README), 4 streams give most of the aggregate gain of batching.
DEFAULT_N_PARALLEL = 4
#: The longest draft of speculative decoding (``--spec-draft-n-max``), llama-server's default
DEFAULT_DRAFT_MAX = 16
#: The mtp label's ``--spec-draft-n-max`` (the spec's MTP defaults): a next-n head drafts a few tokens well
MTP_DRAFT_MAX = 3

#: recipe -> every load option it takes, with lemonkit's default (the bottom of the chain)
RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llamacpp": {"ctx_size": AUTO_CTX_SIZE, "llamacpp_backend": "cpu", "llamacpp_args": "", "merge_args": True},
    # Lemonade's sd-cpp defaults; a row's image_defaults replace them. soft_pixel_cap: an edit's default size
    "diffusers": {"steps": 20, "cfg_scale": 7.0, "width": 512, "height": 512, "soft_pixel_cap": 2048 * 2048},
}
#: recipe -> the load options it understands (everything else in a request is not an option)
RECIPE_OPTIONS: dict[str, tuple[str, ...]] = {recipe: tuple(names) for recipe, names in RECIPE_DEFAULTS.items()}
#: keys an options body may carry that are not options: ``model_name`` so ``effective`` posts back as is
_BODY_KEYS = frozenset({"model_name", "dry_run"})
_UNSET_SPELLINGS = (-1, "", "auto")
#: options only ``null`` unsets: -1, "" and "auto" are no booleans, so they are refused rather than read as "unset"
_BOOL_OPTIONS = frozenset({"merge_args"})


@dataclass(frozen=True)
class ResolvedOptions:
    """One model's options, each dict holding every option its recipe takes.

    Attributes:
        defaults: What applies with nothing saved and nothing requested.
        effective: What a load with this request uses now.
    """

    defaults: dict[str, Any]
    effective: dict[str, Any]


def is_unset(name: str, value: Any) -> bool:
    """Whether ``value`` leaves option ``name`` to the next layer down (see the module doc)."""
    if value is None:
        return True
    if name == "ctx_size" or name in _BOOL_OPTIONS:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    return value in _UNSET_SPELLINGS


def _layer(recipe: str, values: Mapping[str, Any]) -> dict[str, Any]:
    names = RECIPE_OPTIONS.get(recipe, ())
    return {k: v for k, v in values.items() if k in names and not is_unset(k, v)}


def resolve_options(
    info: ModelInfo,
    settings: Settings,
    saved: Mapping[str, Any],
    request: Mapping[str, Any] | None = None,
) -> ResolvedOptions:
    """Resolve ``info``'s options through the whole chain.

    Args:
        info: The model (its recipe and registry row).
        settings: The server's settings.
        saved: Its ``recipe_options.json`` entry (keys that are not options, such as ``pinned``, are ignored).
        request: Options named by the load request, if any.

    Returns:
        ``defaults`` (without ``saved`` and ``request``) and ``effective``, their flag strings merged as
        ``merge_args`` says.
    """
    recipe = info.recipe
    server = {**RECIPE_DEFAULTS.get(recipe, {}), **_layer(recipe, settings.server_options(recipe))}
    row = _layer(recipe, {**info.image_defaults, **info.recipe_options})
    model = {**row, **_layer(recipe, saved), **_layer(recipe, request or {})}
    return ResolvedOptions(defaults=_over_server(server, row), effective=_over_server(server, model))


def _over_server(server: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The per-model options over the server's: each replaces the server's value, but a flag string merges into
    the server's unless the options say ``merge_args: false``."""
    options = {**server, **model}
    if options.get("merge_args") is False:
        return options
    for name, flags in model.items():
        if name.endswith("_args") and isinstance(flags, str) and server.get(name):
            options[name] = _merge_flags(name, server[name], flags)
    return options


def _merge_flags(name: str, server: str, model: str) -> str:
    """``model``'s flags merged over ``server``'s by the engine's own flag table; a string that does not parse
    cannot be merged, so both go through as one string and :func:`check_runnable` refuses it at the load."""
    if name != "llamacpp_args":
        return model  # no flag table to merge by: the model's string replaces the server's
    try:
        return merge_llamacpp_args(server, model)
    except InvalidArgument:
        return f"{server} {model}"


def check_runnable(options: Mapping[str, Any]) -> None:
    """Refuse flags the engine would refuse, so a load fails at the request rather than in a sidecar (whether the
    backend a model names can run here is the manager's to check: it reads the machine).

    Raises:
        InvalidArgument: ``options``' ``llamacpp_args`` do not parse.
    """
    if options.get("llamacpp_args"):
        parse_llamacpp_args(str(options["llamacpp_args"]))


def load_body(model_name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a complete ``/v1/load`` body (keys sorted, as Lemonade prints them)."""
    return dict(sorted({**options, "model_name": model_name}.items()))


# -- context size -------------------------------------------------------------------------------------------------


def rollback_tokens(args: Mapping[str, Any], labels: Iterable[str]) -> int:
    """How many tokens back llama.cpp keeps a recurrent model's states (its ``n_rs_seq``), as the engine asks for
    them: ``--spec-draft-n-max`` where the load speculates (``--spec-type``, ``-md`` or the ``mtp`` label's default
    ``draft-mtp``), else none."""
    kinds = args.get("spec_type")
    if not (kinds if kinds is not None else "model_draft" in args or "mtp" in labels):
        return 0
    return int(args.get("draft_max", MTP_DRAFT_MAX if drafts_with_head(args, labels) else DEFAULT_DRAFT_MAX))


def drafts_with_head(args: Mapping[str, Any], labels: Iterable[str]) -> bool:
    """Whether a load asks to draft with the model's own MTP layers: ``--spec-type draft-mtp``, or the ``mtp``
    label's default where neither ``--spec-type`` nor a draft model is given (the engine loads without where the
    file has no such layers)."""
    kinds = args.get("spec_type")
    return "draft-mtp" in (kinds or ()) or (kinds is None and "model_draft" not in args and "mtp" in labels)


def draft_context(n_ctx: int, n_parallel: int, draft_max: int) -> int:
    """A draft model's context: the target's, with room for every slot's draft beyond the target's cells, so a
    full target leaves no draft context to rebuild."""
    return n_ctx + n_parallel * (draft_max + 1)


def llamacpp_context_size(ctx_size: int | None, n_ctx_train: int | None, *, auto_limit: int | None = None) -> int:
    """The context a llama.cpp load gets: the engine sizes its context with this, the options routes predict it.

    Args:
        ctx_size: The ``ctx_size`` option: ``-1`` or ``None`` is automatic (the trained context, capped at
            ``auto_limit``), ``0`` the whole trained context, anything else itself.
        n_ctx_train: The model's trained context (GGUF ``<arch>.context_length``), when known.
        auto_limit: The most tokens an automatic context may have: what the model's KV cache may take of the
            memory it runs in (:func:`lemonkit.catalog.placement.context_limit`, which the server works out); unknown,
            :data:`DEFAULT_CTX_SIZE`.

    Returns:
        Tokens, padded to a multiple of 256: llama.cpp pads the context so, but llama-cpp-python sizes its
        token buffer by the requested value, so asking for the padded size keeps both in agreement.
    """
    if ctx_size is None or ctx_size == AUTO_CTX_SIZE:
        ctx = min(n_ctx_train or DEFAULT_CTX_SIZE, auto_limit if auto_limit is not None else DEFAULT_CTX_SIZE)
    elif ctx_size == 0:
        ctx = n_ctx_train or DEFAULT_CTX_SIZE
    else:
        ctx = ctx_size
    return -(-ctx // _CTX_PAD) * _CTX_PAD


def resolved_ctx_size(
    info: ModelInfo, effective: Mapping[str, Any], n_ctx_train: int | None, *, auto_limit: int | None = None
) -> int | None:
    """The spec's ``resolved_ctx_size``: the effective ``ctx_size``, or the automatic size when it is ``-1``
    (``auto_limit`` as :func:`llamacpp_context_size` takes it).

    Returns:
        Tokens, or ``None`` for a recipe without a context size.
    """
    ctx = effective.get("ctx_size")
    if not isinstance(ctx, int) or isinstance(ctx, bool):
        return None
    if ctx > 0:
        return ctx
    return llamacpp_context_size(ctx, n_ctx_train, auto_limit=auto_limit) if info.recipe == "llamacpp" else None


# -- saving -------------------------------------------------------------------------------------------------------


def parse_changes(recipe: str, body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Validate a ``POST /v1/models/{id}/options`` body before anything is saved.

    Args:
        recipe: The model's recipe.
        body: The parsed JSON object.

    Returns:
        ``(changes, dry_run)``: option -> new value, ``None`` for an option the body removes.

    Raises:
        InvalidArgument: The body sets ``pinned``, names an option the recipe does not take, or a value is wrong.
    """
    if "pinned" in body:
        raise InvalidArgument('pinned cannot be set here: it belongs to /v1/load ("pinned": true)')
    names = RECIPE_OPTIONS.get(recipe, ())
    unknown = sorted(k for k in body if k not in names and k not in _BODY_KEYS)
    if unknown:
        accepted = ", ".join(names) or "none"
        raise InvalidArgument(f"Recipe {recipe!r} does not take option(s) {', '.join(unknown)} (it takes: {accepted})")
    changes = {k: None if is_unset(k, v) else v for k, v in body.items() if k in names}
    values = {k: v for k, v in changes.items() if v is not None}
    schemas.validate("options", {**values, "dry_run": body.get("dry_run")})
    ctx = values.get("ctx_size")
    if isinstance(ctx, float):
        changes["ctx_size"] = int(ctx)  # 8192.0 is a whole number; save it as one
    check_runnable(values)  # a saved backend or flag string never fails the next load
    return changes, bool(body.get("dry_run"))


def apply_changes(saved: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``changes`` (from :func:`parse_changes`) into a saved entry; keys they do not name keep their values."""
    entry = dict(saved)
    for name, value in changes.items():
        if value is None:
            entry.pop(name, None)
        else:
            entry[name] = value
    return entry
