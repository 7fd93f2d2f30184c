"""The ComfyUI <-> h3_core adapters of nodes/convert.py, on the CPU, without ComfyUI."""

import re
from fractions import Fraction
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.conditioning import RequestError, encode_request
from h3_core.media_write import write_mp4
from h3_core.output import AVLatents, decode_audio, decode_video
from h3_core.pipeline import TINY_CANVAS, sample
from h3_core.references import DecodedAudio, DecodedVideo
from h3_core.resume_point import ResumePoint
from h3_core.tiny import tiny_random_audio_vae, tiny_random_dit, tiny_random_video_vae
from nodes import convert


def frames_video(images, frame_rate, audio=None):
    """A VIDEO of frames in memory (ComfyUI's VideoFromComponents, e.g. from Create Video)."""
    return SimpleNamespace(get_components=lambda: SimpleNamespace(images=images, frame_rate=frame_rate, audio=audio))


def loaded_video(path):
    """A Load Video VIDEO of a file on disk, not trimmed."""
    return SimpleNamespace(get_stream_source=lambda: str(path), get_active_trim_window=lambda: (0.0, 0.0))


def test_image_round_trip_and_channels():
    image = torch.rand(2, 16, 24, 3)
    pils = convert.image_to_pils(image)
    assert [p.size for p in pils] == [(24, 16)] * 2
    assert np.abs(np.asarray(pils[1]) / 255.0 - image[1].numpy()).max() <= 0.5 / 255 + 1e-6
    back = convert.frames_to_image([convert.image_to_uint8(image)])
    assert back.shape == (2, 16, 24, 3) and back.dtype == torch.float32
    assert (back - image).abs().max() <= 0.5 / 255 + 1e-6
    # float blocks as the decoder yields them for an IMAGE, filled in as they come
    assert torch.equal(convert.frames_to_image(iter([image[:1], image[1:]]), 2), image)
    with pytest.raises(ValueError, match="The frame blocks held 2 frames; 3 were expected"):
        convert.frames_to_image(iter([image]), 3)
    with pytest.raises(ValueError, match=r"do not fill an IMAGE of \[1, 16, 24, 3\] from frame 0"):
        convert.frames_to_image(iter([image]), 1)
    rgba = torch.cat([image[:1], torch.zeros(1, 16, 24, 1)], dim=-1)
    assert np.array_equal(np.asarray(convert.image_to_pil(rgba)), np.asarray(pils[0]))  # alpha dropped
    grey = convert.image_to_uint8(torch.full((1, 4, 4, 1), 0.5))
    assert grey.shape == (1, 4, 4, 3) and (grey == 128).all()
    as_bytes = torch.full((1, 4, 4, 3), 128, dtype=torch.uint8)  # a few nodes hand uint8 0..255 on (it went white)
    assert (convert.image_to_uint8(as_bytes) == 128).all() and (convert.image_to_uint8(image.half())[0] ==
                                                                  convert.image_to_uint8(image.half().float())[0]).all()
    with pytest.raises(ValueError, match=r"^last_image's pixels hold NaN or infinite values"):
        convert.image_to_uint8(torch.full((1, 4, 4, 3), float("nan")), "last_image")
    with pytest.raises(ValueError, match=r"\[B, H, W, C\]"):
        convert.image_to_pil(torch.rand(1, 3, 16, 24, 2))
    with pytest.raises(ValueError, match=r"^first_image holds no pictures \(an empty batch, \[0, 16, 24, 3\]\)"):
        convert.image_to_pil(torch.rand(0, 16, 24, 3), "first_image")
    for empty in ((1, 0, 24, 3), (2, 16, 0, 3), (0, 0, 3)):  # a crop node with bad settings: zero rows or columns
        with pytest.raises(ValueError, match=r"^images has no pixels \(\d+x\d+\): connect a picture of some size"):
            convert.image_to_uint8(torch.rand(*empty), "images")


def test_audio_conversions():
    waveform = torch.randn(1, 1, 16000) * 0.1
    decoded = convert.audio_to_decoded({"waveform": waveform, "sample_rate": 16000})
    assert isinstance(decoded, DecodedAudio) and decoded.sample_rate == 16000 and decoded.waveform.shape == (1, 16000)
    stereo = convert.audio_to_stereo_32k({"waveform": waveform, "sample_rate": 16000})
    with pytest.raises(ValueError, match=r"^audio holds no sounds \(an empty batch, \[0, 2, 32000\]\)"):
        convert.audio_to_stereo_32k({"waveform": torch.zeros(0, 2, 32000), "sample_rate": 32000}, "audio")
    assert stereo.shape == (2, 32000) and stereo.dtype == np.float32
    audio = convert.waveform_to_audio([torch.ones(2, 1000), torch.ones(2, 5000)], num_frames=5)
    assert audio["sample_rate"] == 32000 and audio["waveform"].shape == (1, 2, round(5 * 32000 / 24))
    padded = convert.waveform_to_audio([torch.ones(2, 10)], num_frames=5)["waveform"]
    assert padded.shape[-1] == 6667 and padded[..., 10:].abs().sum() == 0
    with pytest.raises(ValueError, match="1 to 8 channels; got 9"):
        convert.audio_to_decoded({"waveform": torch.zeros(1, 9, 100), "sample_rate": 48000})
    with pytest.raises(ValueError, match="drive_audio is a batch of 2 sounds; H3 takes one here"):
        convert.audio_to_decoded({"waveform": torch.zeros(2, 1, 100), "sample_rate": 48000}, "drive_audio")
    pcm = (waveform * 32768).round().to(torch.int16)  # a few nodes hand PCM samples on (they came out +-3000)
    as_pcm = convert.audio_to_decoded({"waveform": pcm, "sample_rate": 16000}).waveform
    assert as_pcm.dtype == torch.float32 and (as_pcm - waveform[0]).abs().max() <= 0.5 / 32768 + 1e-7
    wide = convert.audio_to_decoded({"waveform": pcm.int() << 16, "sample_rate": 16000}).waveform
    assert torch.equal(wide, as_pcm)
    with pytest.raises(ValueError, match=r"samples must be floats in -1..1 \(or int16 / int32 PCM\); got torch.uint8"):
        convert.audio_to_decoded({"waveform": torch.zeros(1, 1, 100, dtype=torch.uint8), "sample_rate": 8000})
    # the same PCM values as floats were encoded as they were: noise, without a word
    with pytest.raises(ValueError, match=r"samples reach \d+; float samples are -1..1 \(PCM values stored as floats\? "
                                         r"divide them by 32768"):
        convert.audio_to_decoded({"waveform": pcm.float(), "sample_rate": 16000})
    assert torch.equal(convert.audio_to_decoded({"waveform": waveform * 2, "sample_rate": 16000}).waveform,
                       waveform[0] * 2)  # a hot mix passes as it is


@pytest.mark.parametrize("channels, layout", [(6, "5.1"), (3, "2.1"), (8, "7.1")])
def test_wide_sound_is_downmixed_as_reading_a_file_of_it_is(tmp_path, channels, layout):
    """A 5.1 AUDIO (Load Audio of a 5.1 file) becomes the stereo that reading the file itself gives (FFmpeg's
    downmix), so a sound given as AUDIO and the same sound read from its file (a Load Video clip) agree."""
    from h3_core.media_read import read_audio

    rate = 32000
    wide = (np.random.default_rng(channels).standard_normal((channels, rate)) * 0.1).astype(np.float32)
    path = tmp_path / "wide.wav"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_f32le", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wide.T).reshape(1, -1), format="flt", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    from_file = read_audio(path)
    given = convert.audio_to_decoded({"waveform": torch.from_numpy(wide)[None], "sample_rate": rate}).waveform
    assert given.shape == (2, rate) and from_file.shape == (2, rate)
    assert np.abs(given.numpy() - from_file).max() < 1e-6
    if layout != "2.1":  # FFmpeg leaves the LFE channel out of a downmix: 2.1 is its first two channels
        assert np.abs(given.numpy() - wide[:2]).max() > 0.01


def test_video_components_to_decoded():
    images = torch.rand(30, 32, 48, 3)
    audio = {"waveform": torch.zeros(1, 2, 44100), "sample_rate": 44100}
    decoded = convert.video_to_decoded(frames_video(images, Fraction(30000, 1001), audio))
    assert isinstance(decoded, DecodedVideo)
    assert decoded.frames.shape == (30, 32, 48, 3) and decoded.frames.dtype == np.uint8
    assert decoded.fps == pytest.approx(29.97, abs=1e-3) and decoded.sample_rate == 44100
    assert convert.video_to_decoded(frames_video(images, Fraction(24))).audio is None
    with pytest.raises(ValueError, match="VIDEO"):
        convert.video_to_decoded(images)


def test_build_request_maps_inputs():
    first = torch.rand(1, 64, 96, 3)
    request = convert.build_request("fl2va", "a fox", first_image=first, aspect_ratio="auto", duration=5.0)
    assert isinstance(request.first_image, Image.Image) and request.first_image.size == (96, 64)
    assert request.aspect_ratio is None and request.width is None and request.references == []
    sized = convert.build_request("t2va", "x", width=256, height=128, aspect_ratio="16:9")
    assert (sized.width, sized.height, sized.aspect_ratio) == (256, 128, None)
    refs = convert.build_request("ref2va", "x", references={"ref10": {"waveform": torch.zeros(1, 1, 64000),
                                                                      "sample_rate": 32000},
                                                            "ref1": None, "ref2": first})
    assert [r.kind for r in refs.references] == ["image", "audio"]  # slot order (ref2 before ref10), empty skipped
    assert refs.names.references == ("references.ref2", "references.ref10")  # the engine's errors name the sockets
    with pytest.raises(ValueError, match=r"^references.ref3 \(image\) is a batch of 5 images; a reference slot takes one "
                                         r"picture"):
        convert.build_request("ref2va", "x", references={"ref3": torch.rand(5, 64, 96, 3)})


def test_a_loaded_video_reference_is_read_from_its_file(tmp_path):
    """A Load Video VIDEO (VideoFromFile) becomes a file reference from its trim start, so only the frames the
    output takes are decoded; a trim with an end, a stream in memory or frames in memory go through
    get_components() as before."""
    import io

    from h3_core.media_write import write_mp4
    from h3_core.references import DecodedVideo

    path = tmp_path / "ref.mp4"
    write_mp4(path, np.zeros((48, 64, 96, 3), np.uint8))
    parts = SimpleNamespace(images=torch.rand(30, 64, 96, 3), frame_rate=Fraction(24), audio=None)
    decoded = []

    def video(source, trim):
        return SimpleNamespace(get_stream_source=lambda: source, get_active_trim_window=lambda: trim,
                               get_components=lambda: decoded.append(source) or parts)

    def reference(value):
        (ref,) = convert.build_request("ref2va", "x", references={"ref0": value}).references
        return ref

    from_file = reference(video(str(path), (1.5, 0.0)))
    assert (from_file.source, from_file.start_seconds, decoded) == (path, 1.5, [])
    assert isinstance(reference(video(str(path), (1.5, 1.0))).source, DecodedVideo)  # trimmed at the end
    assert isinstance(reference(video(io.BytesIO(path.read_bytes()), (0.0, 0.0))).source, DecodedVideo)
    assert isinstance(reference(video(str(tmp_path / "gone.mp4"), (0.0, 0.0))).source, DecodedVideo)
    assert len(decoded) == 3
    assert convert.video_file(SimpleNamespace(get_stream_source=lambda: str(path))) == (str(path), 0.0, 0.0)


    class VideoInput:  # ComfyUI's VIDEO base, whose own get_stream_source encodes the whole clip to H.264
        def get_stream_source(self):
            raise AssertionError("a VIDEO of frames was encoded to find its file")

    class FromFrames(VideoInput):  # ComfyUI's VideoFromComponents (Create Video)
        pass

    class FromFile(VideoInput):
        def get_stream_source(self):
            return str(path)

    assert convert.video_file(FromFrames()) is None and convert.video_file(FromFile()) == (str(path), 0.0, 0.0)

    # frames edited after the file: a subclass cropping in get_components() (a Load Video with a crop), or a
    # newer ComfyUI's pending as_cropped / as_resized, still names the unedited file; their frames are read instead
    class CroppedFile(FromFile):
        def get_components(self):
            return parts

    class Resized(FromFile):
        def has_pending_frame_edits(self):
            return True

    assert convert.video_file(CroppedFile()) is None and convert.video_file(Resized()) is None


def test_a_load_video_clip_is_read_from_its_file_with_its_sound_at_32khz(tmp_path):
    path = tmp_path / "clip.mp4"
    write_mp4(path, np.zeros((48, 64, 96, 3), np.uint8), (np.random.default_rng(0).random((2, 64000)) - 0.5) * 0.2)
    loaded = loaded_video(path)
    clip = convert.video_at_24fps(loaded, "guide", max_frames=24)
    assert clip.frames.shape == (24, 64, 96, 3) and clip.fps == 24.0
    assert clip.sample_rate == 32000 and clip.audio.shape[0] == 2 and clip.audio.shape[1] > 32000
    short = convert.video_at_24fps(loaded, "guide", max_frames=24, sound_frames=12)  # a guide's sound: 0.5 s asked
    assert short.audio.shape == (2, 16000)
    silent = convert.video_at_24fps(loaded, "guide", max_frames=24, with_audio=False)
    assert silent.audio is None and silent.sample_rate is None


def test_latent_packing_checks():
    from h3_core import geometry

    num_frames = 22  # L = 7 latent frames decode to 17 + 5 frames
    latents = AVLatents(torch.randn(1, 24, 7, 4, 6), torch.randn(2, 32, geometry.audio_latents(num_frames)))
    packed = convert.pack_latents(latents, seed=3, task="t2va")
    assert packed["kind"] == convert.LATENT_KIND and packed["num_frames"] == num_frames and packed["seed"] == 3
    back = convert.unpack_latents(packed)
    assert torch.equal(back.video, latents.video) and torch.equal(back.audio, latents.audio)
    with pytest.raises(ValueError, match="H3_LATENT"):
        convert.unpack_latents({"samples": torch.zeros(1, 4, 8, 8)})  # a core LATENT
    assert "resume" not in packed  # a finished clip: nothing to go on from
    stopped = ResumePoint(seed=3, generator_state=torch.Generator().manual_seed(3).get_state(), media_origin=0.5,
                          frames=num_frames)
    packed = convert.pack_latents(AVLatents(latents.video, latents.audio, stopped), seed=3, task="t2va")
    assert convert.unpack_latents(packed).resume is stopped  # a stopped long video's clip: where it stopped goes along


def test_core_av_layout_round_trip_and_checks():
    from h3_core import geometry

    num_frames = 22
    latents = AVLatents(torch.randn(1, 24, 7, 4, 6), torch.randn(2, 32, geometry.audio_latents(num_frames)))
    video, audio = convert.to_core_av(convert.pack_latents(latents, seed=3))
    assert video.shape == (1, 24, 7, 4, 6) and audio.shape == (1, 32, 2, 37)
    assert torch.equal(audio[0, :, 0], latents.audio[0]) and torch.equal(audio[0, :, 1], latents.audio[1])  # L, R
    (back,) = convert.from_core_av(video, audio)
    assert torch.equal(back["video"], latents.video) and torch.equal(back["audio"], latents.audio)
    assert (back["width"], back["height"], back["num_frames"], back["empty"]) == (96, 64, 22, False)

    # a batch of two (one of them zeros: an empty latent only fixes the size), in bf16 as a core sampler may leave it
    two_video = torch.cat([video, torch.zeros_like(video)]).bfloat16()
    two_audio = torch.cat([audio, torch.zeros_like(audio)]).bfloat16()
    first, second = convert.from_core_av(two_video, two_audio)
    assert first["video"].dtype == torch.float32 and torch.equal(first["video"], video.bfloat16().float())
    assert not first["empty"] and second["empty"] and second["audio"].shape == (2, 32, 37)
    (silent,) = convert.from_core_av(video, torch.zeros_like(audio))  # pictures with a silent (zero) sound part
    assert not silent["empty"]

    with pytest.raises(ValueError, match=r"video part must be \[B, 24, L, h, w\]"):
        convert.from_core_av(torch.zeros(1, 16, 7, 4, 6), audio)
    with pytest.raises(ValueError, match=r"audio part must be \[B, 32, 2, A\]"):
        convert.from_core_av(video, torch.zeros(1, 32, 37))
    with pytest.raises(ValueError, match="hold 2 and 1 items"):
        convert.from_core_av(two_video, audio)
    for steps in (8, 1, 2):  # under 7: said so (1 was "The frame count must be positive, got -12"; 2 asked for sound)
        with pytest.raises(ValueError, match=rf"5n \+ 2 >= 7 latent frames .*; got L = {steps}\.$"):
            convert.from_core_av(torch.zeros(1, 24, steps, 4, 6), audio)
    # a 5 s sound encoded apart from 124 frames (5.17 s), joined with core Concat AV Latent: said what to give
    with pytest.raises(ValueError, match=r"The audio part holds 200 latents a channel \(5\.000 s of sound\), but the "
                                         r"video part's 124 frames \(5\.167 s\) take 207: make the sound 5\.175 s long"):
        convert.from_core_av(torch.zeros(1, 24, 37, 4, 6), torch.zeros(1, 32, 2, 200))


def test_node_chain_on_tiny_random(tmp_path):
    """What H3 Conditioning -> H3 Sampler -> H3 VAE Decode -> H3 AV Save do, minus ComfyUI: an fl2va
    request from an IMAGE tensor, 2 steps on tiny-random, IMAGE + AUDIO out, an MP4 with both streams."""
    from h3_core.tiny_text import tiny_random_text_encoder

    video_vae, audio_vae = tiny_random_video_vae(), tiny_random_audio_vae()
    request = convert.build_request("fl2va", "a red fox on a beach", first_image=torch.rand(1, 128, 224, 3),
                                    duration=4.0)
    with pytest.raises(RequestError, match="between 4 and 15 seconds, got 2.0"):  # limits: the engine's
        encode_request(convert.build_request("t2va", "x", duration=2.0), None, rules=TINY_CANVAS)
    cond = encode_request(request, tiny_random_text_encoder(), video_vae, audio_vae, rules=TINY_CANVAS)
    assert cond.num_frames == 107
    latent = convert.pack_latents(sample(tiny_random_dit(), cond, seed=0, steps=2), seed=0, task=cond.task)
    latents = convert.unpack_latents(latent)
    images = convert.frames_to_image(list(decode_video(video_vae, latents.video)))
    audio = convert.waveform_to_audio(list(decode_audio(audio_vae, latents.audio)), latents.num_frames)
    assert images.shape == (107, cond.height, cond.width, 3) and 0 <= images.min() and images.max() <= 1
    assert audio["waveform"].shape == (1, 2, round(107 * 32000 / 24))
    path = write_mp4(tmp_path / "out.mp4", convert.image_to_uint8(images), convert.audio_to_stereo_32k(audio))
    with av.open(str(path)) as container:
        kinds = sorted(s.type for s in container.streams)
        video = container.streams.video[0]
        assert kinds == ["audio", "video"] and (video.width, video.height) == (cond.width, cond.height)


def test_handles_print_without_their_models():
    """ComfyUI prints a failed node's inputs into its error report: a handle's repr names what it holds, never the
    module tree of a 33B DiT, a text encoder or the VAEs (nor a memory manager's patcher, nor LoRA tensors)."""
    from h3_core.references import RELEASE_CANVAS

    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    handles = (
        convert.ModelHandle(module, "fl2va", "dit-name", torch.device("cpu"), loras=((module, 1.0),), patcher=module),
        convert.TextEncoderHandle(module, "encoder-name", RELEASE_CANVAS, patcher=module),
        convert.VAEHandle(module, module, "vae-name", patcher=module),
    )
    for handle, name in zip(handles, ("dit-name", "encoder-name", "vae-name"), strict=True):
        assert name in repr(handle) and "Linear" not in repr(handle), repr(handle)
    latent = convert.empty_latent(224, 128, 22)  # a latent prints its parts' shapes and its facts, not its values
    assert repr(latent) == ("H3_LATENT({'video': [1, 24, 7, 8, 14], 'audio': [2, 32, 37]}, {'kind': 'h3_av_latent', "
                            "'num_frames': 22, 'width': 224, 'height': 128, 'empty': True})")


def test_a_keyframe_warns_of_the_batch_and_of_transparency_in_its_first_picture(caplog):
    opaque = torch.ones(1, 4, 4, 4)
    see_through = torch.cat([opaque, opaque * 0.5])  # the second picture, unused, is the transparent one
    cases = (
        (see_through, ["a batch of 2 images; its first is used"]),
        (see_through.flip(0), ["a batch of 2 images; its first is used", "has transparent pixels"]),
        ((opaque * 255).to(torch.uint8), []),
        ((opaque * 128).to(torch.uint8), ["has transparent pixels"]),  # 0..255 pictures: half-transparent
    )
    for image, expected in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="h3"):
            convert.image_to_pil(image, "first_image")
        said = [record.getMessage() for record in caplog.records]
        assert len(said) == len(expected) and all(part in line for part, line in zip(expected, said)), said


@pytest.mark.parametrize("value, message", [
    (np.zeros((1, 4, 4, 3)), r"first_image must be a ComfyUI IMAGE tensor \[B, H, W, C\], got ndarray\."),
    (torch.zeros(1, 4, 4, 2), r"first_image must be a ComfyUI IMAGE \[B, H, W, C\] with C = 1, 3 or 4; got "
                              r"\[1, 4, 4, 2\]"),
    (torch.zeros(4, 3), r"with C = 1, 3 or 4; got \[4, 3\]"),
    (torch.zeros(0, 4, 4, 3), r"first_image holds no pictures \(an empty batch, \[0, 4, 4, 3\]\)"),
    (torch.zeros(1, 0, 4, 3), r"first_image has no pixels \(4x0\)"),
])
def test_what_is_no_image_is_refused_saying_what_an_image_is(value, message):
    with pytest.raises(ValueError, match=message):
        convert.image_to_pil(value, "first_image")


def test_one_picture_without_its_batch_dimension_is_an_image():
    assert convert.image_to_pil(torch.ones(4, 6, 3)).size == (6, 4)


@pytest.mark.parametrize("block", [torch.zeros(1, 2, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 2, 4),
                                   torch.zeros(2, 2, 3)])
def test_frame_blocks_must_be_rgb_bytes_or_floats(block):
    with pytest.raises(ValueError, match=rf"^Frames must be uint8 or float \[n, H, W, 3\]; got {block.dtype} "
                                         rf"{re.escape(str(list(block.shape)))}\.$"):
        convert.frames_to_image([block])


@pytest.mark.parametrize("task, kinds, keyframes, problem", [
    ("t2va", ["image"], 0, "t2va takes a prompt only"), ("t2va", [], 1, "t2va takes a prompt only"),
    ("t2va", [], 0, None),
    ("fl2va", ["audio"], 1, "fl2va takes first_image / last_image keyframes, not references"),
    ("fl2va", [], 0, "fl2va needs first_image, last_image or both"),
    ("fl2va", [], convert.MAX_KEYFRAMES + 1, "fl2va needs first_image, last_image or both"),
    ("fl2va", [], 1, None), ("fl2va", [], convert.MAX_KEYFRAMES, None),
    ("ref2va", ["image"], 1, "ref2va takes references, not first_image / last_image"),
    ("ref2va", [], 0, "ref2va needs at least one image, video or audio reference"),
    ("ref2va", ["image", "audio"], 0, None),
])
def test_the_media_each_task_takes(task, kinds, keyframes, problem):
    said = convert.media_problem(task, kinds, keyframes)
    assert said == problem if problem is None else said.startswith(problem), said


def test_a_sound_needs_a_positive_sample_rate():
    for rate in (0, -16000):
        with pytest.raises(ValueError, match=rf"^audio: sample_rate must be positive, got {rate}\.$"):
            convert.audio_to_decoded({"waveform": torch.zeros(1, 1, 100), "sample_rate": rate})
    assert convert.audio_to_decoded({"waveform": torch.zeros(1, 1, 100), "sample_rate": 1}).sample_rate == 1


@pytest.mark.parametrize("audio, message", [
    ({"waveform": torch.zeros(1, 2, 100)}, r"^drive_audio must be a ComfyUI AUDIO dict with 'waveform' \[B, C, N\] and "
                                           r"'sample_rate'\.$"),
    ({"sample_rate": 32000}, r"^drive_audio must be a ComfyUI AUDIO dict"),
    (torch.zeros(1, 2, 100), r"^drive_audio must be a ComfyUI AUDIO dict"),
    ({"waveform": [[[0.0]]], "sample_rate": 32000}, r"^drive_audio: waveform must be a tensor \[B, C, N\]; got "
                                                    r"\[\[\[0\.0\]\]\]\.$"),
    ({"waveform": torch.zeros(2, 100), "sample_rate": 32000}, r"^drive_audio: waveform must be a tensor \[B, C, N\]; "
                                                              r"got torch\.Size\(\[2, 100\]\)\.$"),
])
def test_what_is_no_audio_is_refused_saying_what_an_audio_is(audio, message):
    with pytest.raises(ValueError, match=message):
        convert.audio_to_decoded(audio, "drive_audio")


def test_decoded_audio_pieces_must_be_stereo():
    with pytest.raises(ValueError, match=r"^No audio to make an AUDIO from\.$"):
        convert.waveform_to_audio([])
    with pytest.raises(ValueError, match=r"^Decoded audio must be \[2, N\]; got \[1, 10\]\.$"):
        convert.waveform_to_audio([torch.zeros(1, 10)])


@pytest.mark.parametrize("rate", [0, -24, float("nan")])
def test_a_video_without_a_positive_frame_rate_is_refused(rate):
    with pytest.raises(ValueError, match=rf"^guide: frame rate must be positive, got {rate}\.$"):
        convert.video_to_decoded(frames_video(torch.rand(2, 8, 8, 3), rate), "guide")


def test_a_video_in_memory_is_cut_to_24fps_with_its_sound_to_the_frames_asked():
    """A VIDEO that is not a file on disk (another node's frames) comes through get_components: its frames put
    on the 24 fps grid and cut, its sound cut to `sound_frames` frames however many frames are kept."""
    images = torch.rand(48, 8, 8, 3)
    sound = {"waveform": torch.rand(1, 2, 2 * 16000) - 0.5, "sample_rate": 16000}
    video = frames_video(images, Fraction(48), sound)
    clip = convert.video_at_24fps(video, "guide", max_frames=10, sound_frames=12)
    assert clip.fps == 24.0 and clip.frames.shape == (10, 8, 8, 3)
    assert np.array_equal(clip.frames, convert.image_to_uint8(images[0:20:2]))  # every other frame of 48 fps
    assert clip.sample_rate == 16000 and torch.equal(torch.as_tensor(clip.audio), sound["waveform"][0, :, :8000])
    whole = convert.video_at_24fps(video, "guide", max_frames=10)  # no sound_frames: all of its sound
    assert torch.equal(torch.as_tensor(whole.audio), sound["waveform"][0])
    silent = convert.video_at_24fps(video, "guide", max_frames=10, with_audio=False, sound_frames=12)
    assert silent.audio is None and silent.sample_rate is None


def test_an_empty_latent_fixes_the_size_and_is_refused_for_decoding():
    latent = convert.empty_latent(224, 128, 22)  # 22 frames: 7 latent frames, 37 audio latents; 16 pixels a latent
    assert latent["video"].shape == (1, 24, 7, 8, 14) and latent["audio"].shape == (2, 32, 37)
    assert not latent["video"].any() and not latent["audio"].any()
    assert (latent["width"], latent["height"], latent["num_frames"], latent["empty"]) == (224, 128, 22, True)
    convert.refuse_empty_latent({"video": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"^latent holds an empty latent \(H3 Empty AV Latent, or zeros\): connect a "
                                         "sampled one"):
        convert.refuse_empty_latent(latent)


def dit_handle(vsa_gates: bool) -> convert.ModelHandle:
    """A Model Loader's handle of a DiT with or without VSA gates (a FastH3 8-Step V2 student has them)."""
    return convert.ModelHandle(SimpleNamespace(config=SimpleNamespace(vsa_gates=vsa_gates)), "fl2va", "dit",
                               torch.device("cpu"))


@pytest.mark.parametrize("vsa_gates, steps, source", [
    (True, 9, "Turbo contract of FastVideo FastH3 8-Step V2"), (False, 50, "base model defaults: no Turbo contract")])
def test_a_vsa_student_samples_on_its_own_ladder(vsa_gates, steps, source):
    settings = dit_handle(vsa_gates).sampler_settings("t2va")
    assert (settings.steps, settings.source) == (steps, source)


def test_the_sampler_log_counts_the_sigma_points_walked(caplog):
    """Two ladders of their own are walked together up to the shorter: the log says what will run."""
    handle = dit_handle(vsa_gates=False)
    with caplog.at_level("INFO", logger="h3"):
        handle.sampler_settings("t2va", video_sigmas=[1.0, 0.5, 0.0], audio_sigmas=[1.0, 0.7, 0.4, 0.0])
    assert "H3: sampler: 3 sigma points (2 model calls)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="h3"):
        handle.sampler_settings("t2va", audio_sigmas=[1.0, 0.7, 0.4, 0.0])  # the video: 50 steps, longer
    assert "H3: sampler: 4 sigma points (3 model calls)" in caplog.text


def test_what_is_no_reference_is_refused_saying_what_one_is():
    with pytest.raises(ValueError, match=r"^A reference must be an IMAGE, VIDEO or AUDIO; got int\.$"):
        convert.reference_kind(42)
    assert [convert.reference_kind(value) for value in (torch.rand(1, 8, 8, 3), {"waveform": torch.zeros(1, 2, 8)},
                                                        SimpleNamespace(get_components=None))] == \
        ["image", "audio", "video"]
    with pytest.raises(ValueError, match=r"^Unknown reference kind 'text'\.$"):
        convert.reference_source("text", "a fox", "references.ref0")


def test_slots_past_the_last_reference_are_refused_by_name():
    convert.refuse_extra_inputs({})
    with pytest.raises(ValueError, match=r"^references\.ref12, references\.ref13: no such input; references go from "
                                         r"ref0 to ref11 \(H3 takes at most 12\)\.$"):
        convert.refuse_extra_inputs({"references.ref13": 1, "references.ref12": 1})
    with pytest.raises(ValueError, match=r"^strength: no such input\.$"):
        convert.refuse_extra_inputs({"strength": 1})


def test_a_latent_must_have_the_conditionings_size():
    latent = convert.empty_latent(224, 128, 22)
    assert convert.latent_size_problem(latent, 224, 128, 22) is None
    for width, height, frames in ((256, 128, 22), (224, 160, 22), (224, 128, 39)):
        problem = convert.latent_size_problem(latent, width, height, frames)
        assert problem.startswith(f"The latent is 224x128, 22 frames, but the conditioning asks for {width}x{height}, "
                                  f"{frames} frames")


def test_a_size_given_in_part_is_refused_naming_the_half_given():
    """width or height alone (the other left at 0) is refused as such, with an aspect ratio picked or not."""
    from h3_core.conditioning import validate

    for aspect_ratio in ("auto", "16:9"):
        with pytest.raises(RequestError, match=r"^Give width and height together, or neither .*; only the width was "
                                               r"given \(256\)\.$"):
            validate(convert.build_request("t2va", "x", width=256, aspect_ratio=aspect_ratio))
        with pytest.raises(RequestError, match=r"only the height was given \(128\)\.$"):
            validate(convert.build_request("t2va", "x", height=128, aspect_ratio=aspect_ratio))


def test_a_model_handle_knows_a_split_dit():
    here = convert.ModelHandle(torch.nn.Linear(2, 2), "fl2va", "dit", torch.device("cpu"))
    split = convert.ModelHandle(SimpleNamespace(config=None), "fl2va", "dit", torch.device("cuda:0"))
    assert (here.split, split.split) == (False, True)


def test_a_trim_window_in_frames():
    assert [convert.trim_frames(seconds, 100) for seconds in (0.0, 0.01, 1.0, 2.51, 10.0)] == [100, 1, 24, 60, 100]


def test_a_load_video_file_that_cannot_be_read_is_refused_naming_the_input(tmp_path):
    path = tmp_path / "broken.mp4"
    path.write_bytes(b"not a video")
    loaded = loaded_video(path)
    with pytest.raises(ValueError, match=r"^guide: .*broken\.mp4"):
        convert.video_at_24fps(loaded, "guide", max_frames=24)


def test_loras_are_listed_on_a_new_handle_in_the_order_applied():
    """Apply LoRA returns a new handle: the loader's cached one stays without them (its DiT is never merged)."""
    plain = dit_handle(vsa_gates=False)
    first, second = object(), object()
    both = plain.with_lora(first, 0.5).with_lora(second, 1)
    assert plain.loras == () and both.loras == ((first, 0.5), (second, 1.0))
