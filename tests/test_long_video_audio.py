"""Driving audio (lock_source): fitting the track to the output, encoding it to the layout's length, and
slicing it per window on the cumulative 24 fps / 40 Hz timeline with no drift (h3-model.md D, G)."""

import wave

import numpy as np
import pytest
import torch

from h3_core import geometry
from h3_core.continuation import Timeline, audio_at, long_video_frames, plan_windows
from h3_core.drive_audio import check_track, encode_track, fit_track, load_track, window_slice
from h3_core.media import audio_samples_for_frames
from h3_core.references import DecodedAudio, MediaInputError
from h3_core.tiny import tiny_random_audio_vae


def labelled_track(latents: int, channels: int = 4) -> torch.Tensor:
    """[2, C, A] whose every entry says where it came from: channel * 1e6 + index (+ feature / 10)."""
    index = torch.arange(latents, dtype=torch.float64)
    feature = torch.arange(channels, dtype=torch.float64)[:, None] / 10
    return torch.stack([side * 1e6 + index[None] + feature for side in (1, 2)])


@pytest.mark.parametrize("seconds, window, overlap", [(300, 277, 22), (300, 345, 39), (300, 107, 90), (61.3, 124, 22)])
def test_window_slices_tile_the_track(seconds, window, overlap):
    """Over the whole clip each window's slice starts at round(start * 40/24); dropping the overlap and
    laying the slices end to end gives the track back exactly, channel by channel."""
    frames = long_video_frames(seconds)
    windows = plan_windows(frames, window, overlap)
    track = labelled_track(geometry.audio_latents(frames))
    kept = []
    for w in windows:
        piece = window_slice(track, w)
        assert piece.shape[-1] == w.audio_latents
        first = audio_at(w.start)
        assert bool((piece[:, 0, 0] == torch.tensor([1e6, 2e6], dtype=torch.float64) + first).all())
        assert abs(first - w.start * 40 / 24) <= 0.5  # never more than half a latent off the video clock
        # in samples: the slice starts within half a latent (400 samples) of the frame's exact time
        assert abs(first * 800 - audio_samples_for_frames(w.start)) <= 400
        kept.append(piece[..., w.guide_audio_latents :])
    for channel in range(2):
        assert torch.equal(torch.cat([part[channel] for part in kept], dim=-1), track[channel])


def test_the_timeline_returns_the_track_untouched():
    """What the long-video sampler appends for a locked track: the whole clip's audio is the track."""
    frames = long_video_frames(300)
    windows = plan_windows(frames)
    track = labelled_track(geometry.audio_latents(frames), channels=1).float()
    timeline = Timeline()
    for w in windows:
        timeline.guide(w)
        timeline.append(w, torch.zeros(1, 1, w.latent_frames, 1, 1), window_slice(track, w))
    video, audio = timeline.latents()
    assert video.shape[2] == geometry.latent_frames(frames) == 2122
    assert torch.equal(audio, track)


def test_fit_track_cuts_or_pads_each_channel():
    frames = 124
    samples = audio_samples_for_frames(frames)  # 165,333
    left, right = torch.linspace(-1, 1, samples + 500), torch.linspace(1, -1, samples + 500)
    long = fit_track(torch.stack([left, right]), frames)
    assert long.shape == (2, samples)
    assert torch.equal(long[0], left[:samples]) and torch.equal(long[1], right[:samples])
    short = fit_track(torch.stack([left[:1000], right[:1000]]), frames)
    assert short.shape == (2, samples)
    assert torch.equal(short[:, :1000], torch.stack([left[:1000], right[:1000]]))
    assert bool((short[:, 1000:] == 0).all())


@pytest.mark.parametrize("frames", [107, 124, 243])  # F * 40/24 ends in 1/3, 2/3 and 0
def test_encode_track_gives_the_target_length(frames):
    """ceil(M / hop) latents come out of the VAE; the target takes round(F * 40/24) of them."""
    vae = tiny_random_audio_vae()
    seconds = frames / 24
    time = torch.arange(round(seconds * 32000) - 7000) / 32000
    track = torch.stack([torch.sin(2 * np.pi * 220 * time), 0.5 * torch.sin(2 * np.pi * 330 * time)])
    latents = encode_track(vae, track, frames)
    assert latents.shape == (2, 32, geometry.audio_latents(frames))
    whole = vae.encode(fit_track(track, frames))
    assert torch.equal(latents, whole[..., : latents.shape[-1]])
    assert latents.dtype == torch.float32 and latents.device.type == "cpu"


def write_wav(path, waveform: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(waveform.shape[0])
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes((np.clip(waveform.T, -1, 1) * 32767).astype("<i2").tobytes())


def test_load_track_reads_files_and_decoded_audio(tmp_path):
    rate = 16000
    mono = np.sin(np.linspace(0, 200, rate * 2)).astype(np.float32)[None] * 0.5
    write_wav(tmp_path / "voice.wav", mono, rate)
    check_track(tmp_path / "voice.wav")
    from_file = load_track(tmp_path / "voice.wav")
    assert from_file.shape == (2, 64000) and torch.equal(from_file[0], from_file[1])  # mono -> both channels, 32 kHz
    from_memory = load_track(DecodedAudio(torch.from_numpy(mono), rate))
    assert from_memory.shape == (2, 64000)
    assert torch.allclose(from_memory, from_file, atol=2e-4)  # the file held 16-bit samples
    first = load_track(tmp_path / "voice.wav", max_seconds=0.5)  # cut at the native rate, then resampled
    assert first.shape == (2, 16000) and torch.allclose(first[:, :15900], from_file[:, :15900], atol=1e-6)


def test_a_long_video_reads_its_driving_track_no_longer_than_the_clip(tmp_path, monkeypatch):
    """An album-long file as the driving track: read as far as the clip lasts (and a second), not held whole."""
    from h3_core import media_read
    from h3_core.conditioning import Request
    from h3_core.long_video import LongVideoRequest, encode_long_video
    from h3_core.pipeline import TINY_CANVAS
    from h3_core.media import audio_samples_for_frames
    from h3_core.tiny_text import tiny_random_text_encoder
    from h3_core.vae_audio import encode_working_bytes

    rate = 8000
    write_wav(tmp_path / "album.wav", np.zeros((1, rate * 30), np.float32), rate)
    asked, read = [], media_read.read_audio
    monkeypatch.setattr(media_read, "read_audio", lambda *a, **k: asked.append(k.get("max_seconds")) or read(*a, **k))
    request = LongVideoRequest(Request("t2va", "a drum solo", duration=5.0), drive_audio=tmp_path / "album.wav")
    told, audio_vae = [], tiny_random_audio_vae()
    conditioning = encode_long_video(request, tiny_random_text_encoder(), None, audio_vae, rules=TINY_CANVAS,
                                     before_models=lambda rows, media: told.append(media))
    assert asked[-1] == pytest.approx(124 / 24 + 1.0) and conditioning.drive_audio.shape[-1] == round(124 * 40 / 24)
    # room was made for the track's encode (cut to the clip) before any model ran
    assert told == [encode_working_bytes(audio_vae.config, audio_samples_for_frames(124))]

    # a waveform in memory (a ComfyUI AUDIO) is cut as the file is before it is resampled: it was resampled whole,
    # once for the check and again for the encode
    from h3_core import drive_audio

    resampled, resample = [], drive_audio.resample_audio
    monkeypatch.setattr(drive_audio, "resample_audio", lambda w, r: resampled.append(w.shape[-1]) or resample(w, r))
    request = LongVideoRequest(Request("t2va", "a drum solo", duration=5.0),
                               drive_audio=DecodedAudio(torch.zeros(2, rate * 30), rate))
    in_memory = encode_long_video(request, tiny_random_text_encoder(), None, audio_vae, rules=TINY_CANVAS)
    assert resampled and max(resampled) == round((124 / 24 + 1.0) * rate)
    assert torch.equal(in_memory.drive_audio, conditioning.drive_audio)


def test_a_track_undecodable_past_its_first_second_is_refused_before_models(tmp_path):
    """An AAC track garbled half way: the checks read only its first second, so it passed them and the run
    failed after the text encoder, VAEs and DiT had loaded. Now as far as the clip will read it."""
    import av

    from h3_core.conditioning import Request
    from h3_core.long_video import LongVideoRequest, validate_long_video
    from h3_core.pipeline import TINY_CANVAS

    rate, path = 32000, tmp_path / "track.m4a"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "stereo"
        tone = (np.sin(np.arange(rate * 6) / 10) * 0.3).astype(np.float32)
        for start in range(0, tone.size, 1024):
            frame = av.AudioFrame.from_ndarray(np.stack([tone[start:start + 1024]] * 2), format="fltp", layout="stereo")
            frame.sample_rate = rate
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 20000] = bytes((index * 7) & 255 for index in range(20000))
    path.write_bytes(bytes(data))
    check_track(path)  # its first second decodes
    long = LongVideoRequest(Request("t2va", "a drum solo", duration=5.0), drive_audio=path)
    with pytest.raises(ValueError, match="drive audio: .*track.m4a"):
        validate_long_video(long, TINY_CANVAS)


def test_bad_tracks_are_refused_clearly(tmp_path):
    with pytest.raises(MediaInputError, match="does not exist"):
        check_track(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(b"not audio at all")
    with pytest.raises(MediaInputError, match="junk.wav"):
        check_track(tmp_path / "junk.wav")
    write_wav(tmp_path / "empty.wav", np.zeros((2, 0), np.float32), 32000)  # checked before any model loads
    with pytest.raises(MediaInputError, match="drive audio: .*empty.wav has no audio"):
        check_track(tmp_path / "empty.wav")
    with pytest.raises(MediaInputError, match="no samples"):
        load_track(DecodedAudio(torch.zeros(2, 0), 32000))
    with pytest.raises(MediaInputError, match="path to an audio file or a DecodedAudio"):
        load_track(np.zeros((2, 100), np.float32))
    with pytest.raises(MediaInputError, match="sample rate"):
        load_track(DecodedAudio(torch.zeros(2, 100), 0))
    with pytest.raises(MediaInputError, match="drive audio: Audio waveform must be a numpy array or a torch tensor"):
        check_track(DecodedAudio([0.0] * 8000, 8000), seconds=0.5)  # cut only once it is an array
