"""A release fetched from the Hugging Face Hub: only the folders a run reads. One partition is about 134 GiB,
its two VAEs about 10 GiB, so `h3 encode` or a run given its own text encoder should not wait for the rest.
The repo is read in the original release's layout (h3-model.md I.1: FL2VA/ and Ref2VA/ folders)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from .checkpoint import PARTITIONS
from .weights import CheckpointError

log = logging.getLogger("h3_core.hub")  # at INFO: the command line shows it too (cli._WarningNotes)

# the folders of a partition each model is read from (the processor serves the text encoder's images), and
# their sizes in the release (GiB, h3-model.md I.1) for the line saying what is fetched
RELEASE_FOLDERS = {"dit": ("transformer",), "text_encoder": ("text_encoder", "processor"),
                   "tokenizer": ("tokenizer", "processor"), "video_vae": ("video_vae",), "audio_vae": ("audio_vae",)}
FOLDER_GIB = {"transformer": 61.7, "text_encoder": 62.1, "video_vae": 9.7, "audio_vae": 0.56, "tokenizer": 0.007}


def release_folders(partition: str, parts: Sequence[str]) -> list[str]:
    """The partition's folders that hold `parts` (keys of RELEASE_FOLDERS), each once, e.g. FL2VA/video_vae."""
    folder = PARTITIONS[partition][0]
    return [f"{folder}/{sub}" for sub in dict.fromkeys(sub for part in parts for sub in RELEASE_FOLDERS[part])]


def release_patterns(partition: str, parts: Sequence[str]) -> list[str]:
    """huggingface_hub allow_patterns for those folders (`*` matches inside subfolders too)."""
    return [f"{folder}/*" for folder in release_folders(partition, parts)]


def fetch_release(repo: str, partition: str, parts: Sequence[str]) -> Path:
    """The snapshot root holding `parts` of `repo`'s partition (with the DiT, its model_index.json, which says
    whose DiT it is), from the Hugging Face cache or downloaded into it. Failing to reach the Hub is the caller's
    to word; a repo laid out otherwise (no such folders) is refused here, naming what is missing."""
    from huggingface_hub import snapshot_download

    folders = release_folders(partition, parts)
    gib = sum(FOLDER_GIB.get(folder.split("/")[1], 0.0) for folder in folders)
    size = f"{gib:.0f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"
    log.info("H3: fetching %s from %s (about %s, cached after)", ", ".join(folders), repo, size)
    index = [f"{PARTITIONS[partition][0]}/model_index.json"] if "dit" in parts else []
    root = Path(snapshot_download(repo, allow_patterns=index + release_patterns(partition, parts)))
    missing = [folder for folder in folders if not (root / folder).is_dir()]
    if missing and _offline():  # the cache's snapshot as far as it goes, not the repo's listing
        raise CheckpointError(
            f"Not in the Hugging Face cache ({root}): {', '.join(missing)} of {repo}, and the Hub is not asked "
            "(HF_HUB_OFFLINE is set). Go online once, or download them with `hf download "
            f"{repo} {' '.join('--include ' + repr(pattern) for pattern in release_patterns(partition, parts))}`.")
    if missing:
        raise CheckpointError(
            f"Hub repo {repo} has no {', '.join(missing)}. A repo id is read in the original release's layout "
            "(MiniMaxAI/MiniMax-H3: FL2VA/ and Ref2VA/, each with transformer/, text_encoder/, tokenizer/, "
            "processor/, video_vae/ and audio_vae/); download another repo's files and give their paths.")
    return root


def _offline() -> bool:
    """Whether huggingface_hub is told to stay offline (HF_HUB_OFFLINE), as it decides."""
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if callable(check) else constants.HF_HUB_OFFLINE)


def hub_error_text(error: BaseException) -> str:
    """A failed fetch as one line with all it says: huggingface_hub's gated-repo error puts the cause ("Access to
    model ... is restricted ... log in") lines below its "401 Client Error." """
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
