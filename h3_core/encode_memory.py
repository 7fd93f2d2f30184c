"""Device memory the VAEs' encodes need besides their weights: what a host frees before keyframes, references,
guides or a clip of the user's are encoded (ComfyUI's model manager unloads other models for it)."""

from __future__ import annotations

from collections.abc import Iterable

from . import vae_audio, vae_video


def encode_working_bytes(video_vae=None, audio_vae=None, pictures: Iterable[tuple[int, int, int]] = (),
                         sounds: Iterable[int] = ()) -> int:
    """The most one of these encodes needs (they run one after another): `pictures` as (frames, height, width)
    through `video_vae` (1 frame: an image), `sounds` as samples per channel of a stereo track at the audio
    VAE's rate through `audio_vae`. 0 for none; a VAE that is None encodes nothing here."""
    most = 0
    if video_vae is not None:
        for frames, height, width in pictures:
            most = max(most, vae_video.encode_working_bytes(video_vae.config, frames, height, width))
    if audio_vae is not None:
        itemsize = audio_vae.dtype.itemsize
        for samples in sounds:
            most = max(most, vae_audio.encode_working_bytes(audio_vae.config, samples, dtype_bytes=itemsize))
    return most
