"""Final latents to MP4: streamed decode, the file's streams, bounded memory, clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from h3_core import geometry
from h3_core.output import AVLatents, decode_audio, decode_video, write_mp4
from h3_core.resume_point import ResumePoint
from h3_core.tiny import tiny_random_audio_vae, tiny_random_video_vae
from h3_core.vae_video import model_space_to_frames

PROBE = Path(__file__).with_name("stream_memory_probe.py")


@pytest.fixture(scope="module")
def vaes():
    return tiny_random_video_vae(), tiny_random_audio_vae()


def random_latents(frames=124, h=4, w=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, geometry.latent_frames(frames), h, w, generator=g)
    return AVLatents(video, torch.randn(2, 32, geometry.audio_latents(frames), generator=g))


def test_mp4_streams_from_latents(tmp_path, vaes):
    path = write_mp4(tmp_path / "clip.mp4", random_latents(124), *vaes, metadata={"comment": "h3 test"})
    with av.open(str(path)) as container:
        video, audio = container.streams.video, container.streams.audio
        assert len(video) == 1 and len(audio) == 1
        assert video[0].codec_context.name == "h264" and video[0].average_rate == 24
        assert (video[0].codec_context.width, video[0].codec_context.height) == (96, 64)
        assert audio[0].codec_context.name == "aac" and audio[0].rate == 32000 and audio[0].channels == 2
        frames = sum(1 for _ in container.decode(video=0))
        container.seek(0)
        samples = sum(f.samples for f in container.decode(audio=0))
    assert frames == 124
    assert abs(samples - 124 * 32000 / 24) <= 1024  # durations equal within one AAC frame


def test_the_mp4_holds_what_the_decoders_made(tmp_path, vaes, monkeypatch):
    """Colours in RGB order and the left channel on the left: decoders standing in for the VAEs make a
    picture and a sound that tell them apart (tiny random VAEs make noise whose channels look alike)."""
    from h3_core import output

    rgb = torch.tensor([200, 40, 120], dtype=torch.uint8)

    def frames(vae, latents, devices=None, tiled=None):
        for start in range(0, 39, 17):
            yield rgb.expand(min(17, 39 - start), 64, 96, 3).clone()

    def sound(vae, latents, on_window=None):
        t = torch.arange(geometry.audio_latents(39) * 800) / 32000  # 800 samples a latent
        yield torch.stack([0.5 * torch.sin(2 * torch.pi * 440 * t), 0.5 * torch.sin(2 * torch.pi * 1000 * t)])

    monkeypatch.setattr(output, "decode_video", frames)
    monkeypatch.setattr(output, "decode_audio", sound)
    path = write_mp4(tmp_path / "clip.mp4", random_latents(39), *vaes)
    with av.open(str(path)) as container:
        pictures = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        container.seek(0)
        heard = torch.from_numpy(np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=-1))
    assert len(pictures) == 39
    for picture in pictures:
        assert (abs(torch.from_numpy(picture).float().mean((0, 1)) - rgb.float()) < 4).all()  # video-range rounding
    loudest = torch.fft.rfft(heard[:, 4096:36864]).abs().argmax(-1) * 32000 / 32768  # Hz, past the encoder delay
    assert (abs(loudest - torch.tensor([440.0, 1000.0])) < 2).all()


def test_streamed_frames_equal_the_whole_decode(vaes):
    video_vae, _ = vaes
    latents = random_latents(39, 4, 6, seed=3).video
    blocks = list(decode_video(video_vae, latents))
    assert len(blocks) > 1 and all(b.shape[0] <= 17 for b in blocks)  # chunk by chunk, never the clip
    whole = model_space_to_frames(video_vae.decode(video_vae.denormalize_latents(latents)))[0]
    expected = (whole * 255).round().to(torch.uint8).permute(1, 2, 3, 0)
    assert torch.equal(torch.cat(blocks), expected)
    floats = torch.cat(list(decode_video(video_vae, latents, as_uint8=False)))  # an IMAGE's: unrounded
    assert floats.dtype == torch.float32 and torch.equal(floats, whole.permute(1, 2, 3, 0))


def test_the_decoders_inference_mode_stays_inside_them(vaes):
    """A caller's code between blocks runs in its own mode (the Python API's user may want gradients there);
    the decoders' own work runs in inference mode."""
    video_vae, audio_vae = vaes
    latents = random_latents(39, 4, 6, seed=3)
    seen = []
    for block in decode_video(video_vae, latents.video):
        seen.append((torch.is_inference_mode_enabled(), block.is_inference()))
    for piece in decode_audio(audio_vae, latents.audio, on_window=lambda *_: seen.append(
            (torch.is_inference_mode_enabled(), True))):
        seen.append((torch.is_inference_mode_enabled(), piece.is_inference()))
    assert seen[0] == (False, True) and seen[-1] == (False, True)
    assert any(mode for mode, _ in seen)  # on_window is called from inside the audio decode


def test_streamed_audio_equals_the_whole_decode(vaes):
    _, audio_vae = vaes
    latents = random_latents(243, seed=4).audio  # 405 latents: three windows
    pieces = list(decode_audio(audio_vae, latents))
    assert len(pieces) == 3
    assert torch.allclose(torch.cat(pieces, dim=-1), audio_vae.decode(latents, window=10_000), atol=1e-5)


def test_progress_counts_the_soundtrack_windows_then_the_frames_and_can_stop_between(tmp_path, vaes):
    """A long clip's soundtrack is many windows decoded before the first frame: each reports, and a host may stop
    there (an interrupt) without waiting for the rest."""
    calls = []
    write_mp4(tmp_path / "clip.mp4", random_latents(243), *vaes, on_sound=lambda *a: calls.append(("sound", *a)),
              on_frames=lambda *a: calls.append(("frames", *a)))
    # (0, 3) first: a bar shows while the first window decodes (the one before it stood still)
    assert calls[:4] == [("sound", 0, 3), ("sound", 1, 3), ("sound", 2, 3), ("sound", 3, 3)]
    assert calls[4][:2] == ("frames", 17) and calls[-1] == ("frames", 243, 243)

    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop

    with pytest.raises(Stop):
        write_mp4(tmp_path / "stopped.mp4", random_latents(243), *vaes, on_sound=stop,
                  on_frames=lambda *a: pytest.fail("a frame was decoded"))
    assert not (tmp_path / "stopped.mp4").exists()


def test_latents_round_trip_through_safetensors(tmp_path):
    latents = random_latents(124)
    loaded = AVLatents.load(latents.save(tmp_path / "l.safetensors", {"seed": "0"}))
    assert torch.equal(loaded.video, latents.video) and torch.equal(loaded.audio, latents.audio)
    # the file saved over under its name in place (cp, an upload that overwrites): what was loaded stays (it was a
    # view of the file's pages, changed with them, and a file cut short killed the process on the next read)
    with open(tmp_path / "l.safetensors", "r+b") as file:
        file.seek(-4096, os.SEEK_END)
        file.write(bytes(4096))
    assert torch.equal(loaded.video, latents.video) and torch.equal(loaded.audio, latents.audio)
    # readable as any file the process makes (safetensors wrote 0600: a ComfyUI of another user could not load it)
    mask = os.umask(0o027)
    try:
        latents.save(tmp_path / "shared.safetensors")
    finally:
        os.umask(mask)
    assert (tmp_path / "l.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "shared.safetensors").stat().st_mode & 0o777 == 0o640


def test_latents_save_into_new_folders_only_as_safetensors_and_keep_metadata_beside_a_resume_point(tmp_path):
    latents = random_latents(22)
    with pytest.raises(ValueError, match=r"^Latents are saved as \.safetensors; got l\.pt\.$"):
        latents.save(tmp_path / "l.pt")
    assert not list(tmp_path.iterdir())
    nested = latents.save(tmp_path / "runs" / "fox" / "l.safetensors")  # its folders made
    assert torch.equal(AVLatents.load(nested).audio, latents.audio)
    point = ResumePoint(7, torch.Generator().manual_seed(7).get_state(), 1.5, 22)
    resumable = AVLatents(latents.video, latents.audio, point)
    for metadata in (None, {"seed": "7"}):
        path = resumable.save(tmp_path / "r.safetensors", metadata)
        with safe_open(str(path), "pt") as file:
            assert file.metadata().get("seed") == (metadata or {}).get("seed")  # the caller's entries kept
        loaded = AVLatents.load(path).resume
        assert repr(loaded) == repr(point) and torch.equal(loaded.generator_state, point.generator_state)


@pytest.mark.parametrize(
    "video, audio, message",
    [
        ((1, 16, 37, 4, 6), (2, 32, 207), r"\[1, 24, L, h, w\]"),
        ((1, 24, 36, 4, 6), (2, 32, 207), "5n \\+ 2"),
        ((1, 24, 2, 4, 6), (2, 32, 207), "5n \\+ 2"),
        ((1, 24, 37, 4, 6), (1, 32, 207), r"\[2, 32, A\]"),
        ((1, 24, 37, 4, 6), (2, 32, 200), "124 frames take 207 audio latents"),
    ],
)
def test_wrong_latent_shapes_are_clear_errors(tmp_path, vaes, video, audio, message):
    with pytest.raises(ValueError, match=message):  # by the check itself (what a latents file read back gets), no decoder
        AVLatents(torch.zeros(video), torch.zeros(audio)).check()
    with pytest.raises(ValueError, match=message):
        write_mp4(tmp_path / "x.mp4", AVLatents(torch.zeros(video), torch.zeros(audio)), *vaes)
    assert not (tmp_path / "x.mp4").exists()


def test_latents_are_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails partway (a full disk) left a half file under the final name, read later as damaged;
    a link at the name was written through. Now the latents go to a hidden name and are moved into place."""
    from h3_core import output

    latents = random_latents(22, seed=5)
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    (tmp_path / "linked.safetensors").symlink_to(target)
    latents.save(tmp_path / "linked.safetensors")
    assert target.read_text() == "keep me" and not (tmp_path / "linked.safetensors").is_symlink()
    assert torch.equal(AVLatents.load(tmp_path / "linked.safetensors").video, latents.video)

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        latents.save(tmp_path / "full.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "linked.safetensors"]

    def full_disk_in_safetensors_words(tensors, path, metadata=None):  # what safetensors itself raises there
        Path(path).write_bytes(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(output, "save_file", full_disk_in_safetensors_words)
    with pytest.raises(OSError, match=r"^Saving the latents to .*full.safetensors failed: .*No space left"):
        latents.save(tmp_path / "full.safetensors")  # an OSError, which h3 says in one line (it was a traceback)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "linked.safetensors"]

    def refused_before_a_byte(tensors, path, metadata=None):  # safetensors' words for a folder gone meanwhile
        raise SafetensorError("Error while serializing: I/O error: No such file or directory (os error 2)")

    monkeypatch.setattr(output, "save_file", refused_before_a_byte)
    with pytest.raises(OSError, match=r"^Saving the latents to .*gone.safetensors failed: .*No such file"):
        latents.save(tmp_path / "gone.safetensors")  # the error said, not the missing hidden file's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "linked.safetensors"]

    def stopped_before_a_byte(tensors, path, metadata=None):  # Ctrl-C before the file was made
        raise KeyboardInterrupt

    monkeypatch.setattr(output, "save_file", stopped_before_a_byte)
    with pytest.raises(KeyboardInterrupt):  # itself, not the missing hidden file's error
        latents.save(tmp_path / "stopped.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "linked.safetensors"]


def test_latents_larger_or_longer_than_h3_makes_are_refused_as_they_load(tmp_path):
    """A 15 MB file of latents from elsewhere said 4800 px wide and took 18.5 GB to decode (the pack's canvas
    limit is 4096 a side); one of more frames than H3's longest clip (300 s) is refused the same way."""
    cases = [((1, 24, 7, 8, 300), 22, r"decode to 4800x128, not an H3 canvas: .*at most 4096"),
             ((1, 24, 7, 8, 9), 22, r"decode to 144x128, not an H3 canvas: .*multiples of 32"),
             ((1, 24, 2127, 2, 2), 7230, r"decode to 7230 frames; H3's longest clip is 7213 \(300 s\)")]
    for video, frames, message in cases:
        path = AVLatents(torch.zeros(video), torch.zeros(2, 32, geometry.audio_latents(frames))).save(tmp_path / "x.safetensors")
        with pytest.raises(ValueError, match=message):
            AVLatents.load(path).check()
    longest = AVLatents(torch.zeros(1, 24, 2122, 2, 2), torch.zeros(2, 32, geometry.audio_latents(7213)))
    assert longest.num_frames == 7213 and longest.check() is longest


def test_non_finite_latents_are_refused(tmp_path, vaes):
    latents = random_latents(124)
    latents.video[0, 3, 5, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        write_mp4(tmp_path / "x.mp4", latents, *vaes)


def test_latents_files_in_float8_are_widened_and_integer_ones_refused(tmp_path):
    """A float8 latents file (e.g. --continue-from) failed with torch's raw "isfinite not implemented for
    Float8_e4m3fn"."""
    latents = random_latents(124)
    AVLatents(latents.video.to(torch.float8_e4m3fn), latents.audio.to(torch.float8_e5m2)).save(tmp_path / "fp8.safetensors")
    loaded = AVLatents.load(tmp_path / "fp8.safetensors").check()
    assert loaded.video.dtype == loaded.audio.dtype == torch.float32
    assert torch.equal(loaded.video, latents.video.to(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="The audio latents are int64; latents are floating point"):
        AVLatents(latents.video, latents.audio.long()).check()
    AVLatents(latents.video, latents.audio.to(torch.int8)).save(tmp_path / "int8.safetensors")  # one byte, not float
    with pytest.raises(ValueError, match="The audio latents are int8; latents are floating point"):
        AVLatents.load(tmp_path / "int8.safetensors").check()


def test_a_file_that_is_not_safetensors_is_no_latents_file(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(64))
    with pytest.raises(ValueError, match=r"clip.mp4 is not a safetensors file of latents \(.*\); give the "
                                         r".safetensors that --save-latents, h3 encode or AVLatents.save wrote"):
        AVLatents.load(tmp_path / "clip.mp4")


def test_a_safetensors_file_without_both_latents_is_refused_naming_what_it_lacks(tmp_path):
    latents = random_latents(22)
    save_file({"video": latents.video}, str(tmp_path / "video_only.safetensors"))
    save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    for name, lacking in (("video_only", "audio"), ("model", "audio, video")):
        with pytest.raises(ValueError, match=rf"{name}\.safetensors lacks the tensor\(s\) {lacking}; expected 'video' "
                                             r"and 'audio'\.$"):
            AVLatents.load(tmp_path / f"{name}.safetensors")


def test_extreme_latents_from_elsewhere_are_named_as_a_cause_of_a_non_finite_decode(tmp_path, vaes):
    latents = random_latents(124)
    latents.video.mul_(1e30)  # finite, far beyond anything a sampler makes
    with pytest.raises(ValueError, match=r"from finite latents \(largest \|value\| \d.*e\+30\): the latents are far "):
        write_mp4(tmp_path / "x.mp4", latents, *vaes)


def test_a_video_vae_with_nan_weights_is_an_error_not_a_black_clip(tmp_path):
    video_vae = tiny_random_video_vae()
    with torch.no_grad():
        video_vae.post_quant_conv.weight[0].fill_(float("nan"))
    with pytest.raises(ValueError, match="The video VAE decoded NaN or infinite values from finite latents"):
        write_mp4(tmp_path / "x.mp4", random_latents(124), video_vae, tiny_random_audio_vae())
    assert not (tmp_path / "x.mp4").exists()


def _probe(seconds: int, tmp_path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(PROBE), str(seconds), "256", "128", str(tmp_path / f"{seconds}.mp4")],
        capture_output=True, text=True, check=True, timeout=900, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_minute_streams_in_the_memory_of_five_seconds(tmp_path):
    """60 s of 256x128 video (1450 frames: 142 MB as uint8, 570 MB as float frames) decoded and muxed,
    each clip in a fresh process: the 60 s peak is at most twice the 5 s peak, and what the run adds
    above its post-setup baseline stays below the decoded clip's size. (Resident memory also holds
    allocator slack that varies with machine load, so the bounds leave room for it.)"""
    short, long = _probe(5, tmp_path), _probe(60, tmp_path)
    assert long["frames"] == 1450
    assert long["peak"] <= 2 * short["peak"]
    assert long["peak"] - long["rss_before"] < 1450 * 256 * 128 * 3 * 4  # never held the decoded clip


def test_the_decoders_refuse_latents_they_cannot_decode_whole(vaes):
    """decode_video kept the first of a batch of clips and dropped the rest without a word, decode_audio made NaN
    sound of NaN latents, and numpy or empty latents failed inside the VAEs: each said before a decoder runs."""
    video_vae, audio_vae = vaes
    latents = random_latents(22)
    with pytest.raises(ValueError, match=r"^decode_video takes one clip's latents \[1, C, L, h, w\]; got a batch of 2\."):
        next(decode_video(video_vae, torch.cat([latents.video, latents.video])))
    broken = latents.audio.clone()
    broken[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^The audio latents hold NaN or infinite values"):
        next(decode_audio(audio_vae, broken))
    for wrong, name, decode in ((latents.video.numpy(), "video", lambda x: decode_video(video_vae, x)),
                                (torch.zeros(2, 32, 0), "audio", lambda x: decode_audio(audio_vae, x))):
        with pytest.raises(ValueError, match=rf"^The {name} latents must be a non-empty tensor"):
            next(decode(wrong))
