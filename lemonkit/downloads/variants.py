"""``GET /v1/pull/variants``: the quants a GGUF repo offers (sharded groups as one), its mmproj files, labels."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from lemonkit.catalog.hf_cache import shard_prefix
from lemonkit.downloads.hub_api import Listing

__all__ = ["PREFERRED_QUANTS", "list_variants"]

#: the quants lemonade's catalog uses most, in that order; the rest follow alphabetically
PREFERRED_QUANTS = ("Q4_K_M", "UD-Q4_K_XL", "Q8_0", "Q4_0")
_MAX_VARIANTS = 5
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+_[A-Z0-9]+(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|FP16|MXFP4(?:_MOE)?))"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)


def _quant_name(path: str) -> str:
    stem = PurePosixPath(path).name
    prefix = shard_prefix(stem)
    stem = prefix if prefix is not None else stem[: -len(".gguf")]
    found = _QUANT.findall(stem)
    if found:
        return str(found[-1]).upper()
    folder = PurePosixPath(path).parent.name
    return folder or stem


def list_variants(checkpoint: str, listing: Listing) -> dict[str, Any]:
    """The spec's variants answer for a repo listing: top quants (sharded groups as one), mmproj files, labels."""
    repo = listing.repo
    ggufs = [p for p in listing.files if p.lower().endswith(".gguf")]
    mmproj = sorted(p for p in ggufs if "mmproj" in PurePosixPath(p).name.lower())
    groups: dict[str, list[str]] = {}
    for path in ggufs:
        if path in mmproj:
            continue
        prefix = shard_prefix(path)
        groups.setdefault(prefix if prefix is not None else path, []).append(path)
    variants: dict[str, dict[str, Any]] = {}
    for files in sorted(groups.values(), key=lambda fs: (len(fs) > 1, len(fs[0]), fs[0])):
        files.sort()
        name = _quant_name(files[0])
        if name in variants:
            continue  # one entry per quant name: the plain file before shards, then the shortest path
        variants[name] = {
            "name": name,
            "primary_file": files[0],
            "files": files,
            "sharded": len(files) > 1 or shard_prefix(files[0]) is not None,
            "size_bytes": sum(listing.files[f].size for f in files),
        }

    def rank(name: str) -> tuple[int, str]:
        upper = name.upper()
        return (PREFERRED_QUANTS.index(upper) if upper in PREFERRED_QUANTS else len(PREFERRED_QUANTS), name)

    labels = ["vision"] if mmproj else []
    lowered = repo.lower()
    if "embed" in lowered:
        labels.append("embeddings")
    if "rerank" in lowered:
        labels.append("reranking")
    return {
        "checkpoint": checkpoint,
        "recipe": "llamacpp",
        "suggested_name": repo.split("/", 1)[1],
        "suggested_labels": labels,
        "mmproj_files": mmproj,
        "variants": [variants[n] for n in sorted(variants, key=rank)[:_MAX_VARIANTS]],
    }
