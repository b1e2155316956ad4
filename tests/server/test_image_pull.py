"""Lemonade's ``SD-Turbo`` runs on diffusers: pulling it fetches the diffusers layout of ``stabilityai/sd-turbo``
(here the tiny random pipeline, served by ``tests/support/hub_server.py`` in the real repo's shape: fp32 and fp16
weights side by side, single-file checkpoints at the root) and the model then generates, on both hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lemonkit.catalog.diffusers_layout import diffusers_files
from lemonkit.testing.tiny_diffusers import TINY_SIZE, write_tiny_pipeline
from tests.server.test_images import check_answer
from tests.server.test_pull import Env, env, model, pull_standalone  # noqa: F401 - fixtures

REPO = "stabilityai/sd-turbo"
#: the weights a pull must skip: the root's single-file checkpoints, fp32 copies of fp16 weights, the NSFW checker
SKIPPED = (
    "sd_turbo.safetensors",
    "sd_turbo.ckpt",
    "unet/diffusion_pytorch_model.safetensors",
    "text_encoder/model.safetensors",
    "safety_checker/model.safetensors",
    "vae/diffusion_pytorch_model.msgpack",
)


def sd_turbo_repo(tmp: Path) -> dict[str, bytes | Path]:
    """The tiny pipeline laid out as stabilityai/sd-turbo: fp16 unet and text encoder next to their fp32 files."""
    from safetensors.torch import load_file, save_file

    root = write_tiny_pipeline(tmp / "sd-turbo")
    for component, name in (("unet", "diffusion_pytorch_model"), ("text_encoder", "model")):
        weights = load_file(root / component / f"{name}.safetensors")
        save_file({k: v.half() for k, v in weights.items()}, root / component / f"{name}.fp16.safetensors")
    files: dict[str, bytes | Path] = {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file()}
    files.update({name: b"not loaded" for name in SKIPPED if name not in files})
    files.update({"README.md": b"# SD-Turbo\n", "safety_checker/config.json": b"{}"})
    return files


def test_the_download_plan_of_a_diffusers_repo(tmp_path: Path) -> None:
    files = sd_turbo_repo(tmp_path)
    chosen = diffusers_files(files)
    assert "model_index.json" in chosen and "unet/diffusion_pytorch_model.fp16.safetensors" in chosen
    assert "vae/diffusion_pytorch_model.safetensors" in chosen  # no fp16 copy: the fp32 file
    assert not set(SKIPPED) & set(chosen) and not any(c.startswith("safety_checker/") for c in chosen)
    assert diffusers_files([p for p in files if p != "model_index.json"]) == []  # no index: no pipeline


@pytest.fixture(scope="module")
def sd_turbo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes | Path]:
    """The repo's files, on disk for as long as the module's hub serves them (both hosts' tests)."""
    return sd_turbo_repo(tmp_path_factory.mktemp("sd-turbo-repo"))


@pytest.mark.slow
async def test_pull_sd_turbo_then_generate(env: Env, sd_turbo_files: dict[str, bytes | Path]) -> None:  # noqa: F811
    if env.hub._lookup(REPO) is None:
        env.hub.add_repo(REPO, sd_turbo_files)
    async with env.client() as client:
        before = await model(client, "SD-Turbo")
        assert before["recipe"] == "diffusers" and before["checkpoint"] == REPO and before["supported"], before
        assert before["image_defaults"]["steps"] == 4
        response = await client.post("pull", json={"model_name": "SD-Turbo"})
        assert response.status_code == 200 and response.json()["status"] == "success", response.text
        assert (await model(client, "SD-Turbo"))["downloaded"] is True
        answer = await client.post(
            "images/generations",
            json={"model": "SD-Turbo", "prompt": "a lighthouse", "size": f"{TINY_SIZE}x{TINY_SIZE}", "seed": 1},
        )
    assert answer.status_code == 200, answer.text
    check_answer(answer.json(), 1, TINY_SIZE, TINY_SIZE)
    assert answer.json()["data"][0]["generation_info"]["steps"] == 4  # SD-Turbo's image_defaults
    snapshots = list((env.storage(REPO) / "snapshots").iterdir())
    assert len(snapshots) == 1
    fetched = sorted(str(p.relative_to(snapshots[0])) for p in snapshots[0].rglob("*") if p.is_file())
    assert fetched == diffusers_files(sd_turbo_files)
