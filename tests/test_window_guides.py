"""Guides in a long video (window_guides.py): which window makes a guide's frames, how a sound is shared
out, and that one window with guides is the same request as one clip with H3 Add Guide's guides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from wav_files import write_wav

from h3_core.cli import main
from h3_core.conditioning import Request, RequestError, encode_request
from h3_core.continuation import plan_windows
from h3_core.guides import GuideMedia, add_guide, encode_guide, guide_encode_bytes
from h3_core.layout import FRAME_TIME, GuideBlock
from h3_core.long_video import LongVideoRequest, encode_long_video, sample_long_video, validate_long_video
from h3_core.pipeline import TINY_CANVAS, sample
from h3_core.tiny import tiny_random_audio_vae, tiny_random_dit, tiny_random_video_vae
from h3_core.tiny_text import tiny_random_text_encoder
from h3_core.window_guides import new_part_start, owning_window, sound_slices

STEPS = 3
PROMPT = "A red fox trots along a beach at sunset; waves crash softly and gulls call."
TWENTY_SECONDS = plan_windows(481, 277, 22)  # (0, 277), (255, 481)
FORTY_SECONDS = plan_windows(974, 277, 22)  # starts 0, 255, 510, 765


@pytest.fixture(scope="module")
def models():
    return {"text": tiny_random_text_encoder(), "video": tiny_random_video_vae(), "audio": tiny_random_audio_vae()}


def picture(seed: int, frames: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 128, 224, 3), dtype=np.uint8)


def noise_sound(seconds: float, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, int(32000 * seconds))).astype(np.float32) * 0.1


def long_request(seconds=20.0, guides=(), **options) -> LongVideoRequest:
    return LongVideoRequest(Request("t2va", PROMPT, duration=seconds), guides=tuple(guides), **options)


def encode(models, seconds=20.0, guides=(), **options):
    return encode_long_video(long_request(seconds, guides, **options), models["text"], models["video"],
                             models["audio"], rules=TINY_CANVAS)


def test_a_frame_belongs_to_the_window_that_makes_it():
    # window 2 repeats frames 255-276 from window 1: those are window 1's
    assert [owning_window(TWENTY_SECONDS, f).index for f in (0, 254, 255, 276, 277, 480)] == [0, 0, 0, 0, 1, 1]
    with pytest.raises(RequestError, match="outside the clip's 481 frames"):
        owning_window(TWENTY_SECONDS, 481)


def test_a_sound_is_heard_once_end_to_end():
    anchor, latents = 200, round(FRAME_TIME * (974 - 200))
    slices = sound_slices(FORTY_SECONDS, anchor, latents)
    assert [window.index for window, *_ in slices] == [0, 1, 2, 3]
    assert [local for _, local, _, _ in slices] == [200, 22, 22, 22]  # later windows: right after their tail
    firsts = [first for _, _, first, _ in slices]
    counts = [count for _, _, _, count in slices]
    assert firsts[0] == 0 and all(a + n == b for a, n, b in zip(firsts, counts, firsts[1:]))  # no gap, no repeat
    assert latents - 1 <= firsts[-1] + counts[-1] <= latents  # the clip's end, floored as one request floors it
    for window, local, first, _ in slices:  # each slice starts within half a latent of where it is laid
        assert abs(FRAME_TIME * (window.start + local) - (FRAME_TIME * anchor + first)) <= 0.5
    for window, local, _, count in slices:  # and fits in its window from there
        assert count <= window.audio_latents - FRAME_TIME * local
    short = sound_slices(FORTY_SECONDS, 400, 30)  # 0.75 s from frame 400: window 2 only
    assert [(w.index, local, first, count) for w, local, first, count in short] == [(1, 145, 0, 30)]
    # a sound that ends inside a window's new part is all there: the next window's frame-early start (where a
    # window could not hold it to its end) must not hand its last latent out again
    ending = sound_slices(plan_windows(1807), 255, 36)  # 0.9 s from frame 255, the release's 75 s plan
    assert [(w.index, local, first, count) for w, local, first, count in ending] == [(0, 255, 0, 36)]


@pytest.mark.parametrize("frames,window_frames,overlap", [(1246, 345, 22), (736, 107, 90), (974, 277, 22)])
def test_no_latent_of_a_sound_is_left_out_whatever_the_windows(frames, window_frames, overlap):
    """Where a window's whole latents end a fraction of one before the next window's new part, the next window's
    slice starts a frame early, inside the overlap it does not keep (a latent given twice is heard once); every
    slice is laid within half a latent of its time. Every anchor of a sound that reaches past its window."""
    windows = plan_windows(frames, window_frames, overlap)
    early = 0
    for anchor in range(frames):
        latents = round(FRAME_TIME * (frames - anchor))
        slices = sound_slices(windows, anchor, latents)
        covered = set()
        for (window, local, first, count), following in zip(slices, [*slices[1:], None]):
            covered |= set(range(first, first + count))
            assert abs(FRAME_TIME * (window.start + local) - (FRAME_TIME * anchor + first)) <= 0.5
            assert count <= window.audio_latents - FRAME_TIME * local
            if following is not None:
                next_window, next_local, next_first, _ = following
                assert next_first <= first + count  # no gap
                if next_first < first + count:  # given twice: only inside the next window's hidden overlap
                    assert next_window.start <= next_window.start + next_local < new_part_start(next_window)
                    early += 1
        assert covered >= set(range(latents - 1)), anchor  # the clip's end floored as one request floors it
    assert early > 0 if (window_frames, overlap) != (277, 22) else early == 0  # the release's plan needs none


def test_guides_land_in_the_windows_that_make_their_frames(models):
    guides = [
        GuideMedia(100, frames=picture(1, frames=30)),  # a 22-frame clip: window 1, 7 latent frames
        GuideMedia(250, waveform=noise_sound(12.0), sample_rate=32000),  # from window 1 on into window 2
        GuideMedia(-1, frames=picture(2)),  # the last frame: window 2, local 480 - 255
    ]
    told = []  # a host makes room for the largest guide encode before any model runs
    cond = encode_long_video(long_request(guides=guides), models["text"], models["video"], models["audio"],
                             rules=TINY_CANVAS, before_models=lambda rows, media: told.append(media))
    each = [guide_encode_bytes(g.frames, g.waveform, g.sample_rate, 224, 128, models["video"], models["audio"])
            for g in guides]
    assert told == [max(each)] and min(each) > 0
    shares = [(g.window, g.block) for g in cond.guides]
    first_part = round(FRAME_TIME * (277 - 250))  # the sound up to where window 2's new part starts
    rest = cond.guides[2].block.audio_latents
    assert shares == [(0, GuideBlock(100, 7, 0)), (0, GuideBlock(250, 0, first_part)), (1, GuideBlock(22, 0, rest)),
                      (1, GuideBlock(225, 1, 0))]
    assert rest == round(FRAME_TIME * (481 - 250)) - first_part  # 12 s reach past the clip's end: cut there
    _, whole = encode_guide(None, guides[1].waveform, 32000, 224, 128, 481, audio_vae=models["audio"])
    assert torch.equal(torch.cat([cond.guides[1].audio, cond.guides[2].audio], -1), whole[..., :first_part + rest])

    # window 2 packs [text | tail | sound | image | target]; its conditioning holds them in that order
    window = cond.windows[1]
    tail = (torch.randn(1, 24, window.guide_latent_frames, 8, 14), torch.randn(2, 32, window.guide_audio_latents))
    request = cond.window(window, tail)
    assert len(request.visual_condition_latents) == 2
    assert torch.equal(request.visual_condition_latents[1], cond.guides[3].video)
    assert request.audio_condition_rows.shape[1] == 2 * (window.guide_audio_latents + rest)
    layout = cond.window_layout(window)
    assert layout.num_condition_video_rows == (window.guide_latent_frames + 1) * 28
    plain = encode(models)
    assert layout.sequence_length == plain.window_layout(window).sequence_length + 28 + 2 * rest

    dit = tiny_random_dit()
    guided, unguided = sample_long_video(dit, cond, seed=3, steps=STEPS), sample_long_video(dit, plain, 3, STEPS)
    assert guided.video.shape == unguided.video.shape and guided.audio.shape == unguided.audio.shape
    assert not torch.equal(guided.video[:, :, :82], unguided.video[:, :, :82])


def test_one_window_with_guides_is_one_request_with_add_guide(models):
    clip, sound = picture(4, frames=22), noise_sound(3.0, seed=5)
    long = encode(models, seconds=10.0, mode="full", guides=[GuideMedia(60, clip, sound, 32000), GuideMedia(-1, picture(6))])
    plain = encode_request(Request("t2va", PROMPT, duration=10.0), models["text"], rules=TINY_CANVAS)
    plain = add_guide(plain, 60, models["video"], models["audio"], clip, sound, 32000)
    plain = add_guide(plain, -1, models["video"], frames=picture(6))
    window = long.window(long.windows[0], None)
    assert torch.equal(window.layout.position_ids, plain.layout.position_ids)
    assert all(torch.equal(a, b) for a, b in zip(window.visual_condition_latents, plain.visual_condition_latents,
                                                  strict=True))
    assert torch.equal(window.audio_condition_rows, plain.audio_condition_rows)
    dit = tiny_random_dit()
    whole, alone = sample_long_video(dit, long, seed=8, steps=STEPS), sample(dit, plain, 8, STEPS)
    assert torch.equal(whole.video, alone.video) and torch.equal(whole.audio, alone.audio)


@pytest.mark.parametrize("guides, options, message", [
    ([GuideMedia(270, frames=picture(1, frames=22))], {},
     r"Guide 1: its 22-frame clip from frame 270 crosses the end of window 1 .*The windows made end at frames 277, 481"),
    ([GuideMedia(100, waveform=noise_sound(1.0), sample_rate=32000)], {"drive_audio": "DRIVE"},
     "a driving soundtrack fixes the whole clip's audio"),
    ([GuideMedia(481, frames=picture(1))], {}, "frame_index 481 is outside the video's 481 frames"),
    ([GuideMedia(0)], {}, "needs frames"),
    (["frame.png"], {}, "takes its guides as guides.GuideMedia; guide 1 is a str"),
])
def test_bad_guides_fail_before_any_model(tmp_path, guides, options, message):
    if options.get("drive_audio") == "DRIVE":
        options["drive_audio"] = tmp_path / "drive.wav"
        write_wav(options["drive_audio"], 2.0)
    with pytest.raises(RequestError, match=message):
        validate_long_video(long_request(guides=guides, **options), TINY_CANVAS)


def test_cli_long_video_takes_guides(tmp_path):
    Image.fromarray(picture(7)[0]).save(tmp_path / "key.png")
    write_wav(tmp_path / "bell.wav", 2.0)
    out, plain = tmp_path / "guided.safetensors", tmp_path / "plain.safetensors"
    argv = ["generate", "--long-video", "--duration", "20", "--steps", "2", "--prompt", PROMPT]
    assert main([*argv, "--guide", "300:image=" + str(tmp_path / "key.png"), 
                 "--guide=-100:audio=" + str(tmp_path / "bell.wav"), "--save-latents", str(out)]) == 0
    assert main([*argv, "--save-latents", str(plain)]) == 0
    guided, unguided = load_file(str(out)), load_file(str(plain))
    assert guided["video"].shape == unguided["video"].shape == (1, 24, 142, 8, 14)
    # window 1 (frames 0-276, latent frames 0-81) is the same request; window 2 has both guides
    assert torch.equal(guided["video"][:, :, :82], unguided["video"][:, :, :82])
    assert not torch.equal(guided["video"][:, :, 82:], unguided["video"][:, :, 82:])


def test_a_video_guide_file_is_read_no_longer_than_a_window(tmp_path):
    """A clip must fit in one window, so reading more of a long file would only hold frames in memory."""
    from h3_core.guides import GuideFile, read_guide
    from h3_core.media_write import write_mp4

    path = tmp_path / "long.mp4"
    write_mp4(path, np.zeros((400, 48, 64, 3), dtype=np.uint8), np.zeros((2, 32000 * 17), dtype=np.float32))
    from h3_core import media_read

    frames, sound, rate = read_guide(GuideFile(0, "video", path), 974, clip_frames=277)
    assert frames.shape[0] == 277  # the sound runs on past the clip, over the windows after (as from memory)
    assert np.array_equal(sound, media_read.read_audio(path)) and sound.shape[1] > round(16.6 * rate)
    assert read_guide(GuideFile(0, "video", path), 974)[0].shape[0] == 400


def test_a_video_guide_files_soundtrack_runs_on_past_its_picture_up_to_where_the_video_ends(tmp_path):
    """As a guide VIDEO's in memory (H3 Add Guide): a file whose soundtrack outlasts its picture gave only the
    picture's span of sound."""
    from test_media_edges import write_clip

    from h3_core.guides import GuideFile, read_guide

    path = tmp_path / "short_picture.mp4"
    write_clip(path, 30, 3.0)  # 1.25 s of picture, 3 s of sound
    frames, sound, rate = read_guide(GuideFile(0, "video", path), 107)
    assert frames.shape[0] == 30 and abs(sound.shape[1] - 3 * rate) < 1024
    frames, sound, rate = read_guide(GuideFile(60, "video", path), 107)  # 47 frames left in the video
    assert frames.shape[0] == 30 and sound.shape[1] == round(47 / 24 * rate)


def test_a_video_guide_file_is_read_only_up_to_where_the_video_ends(tmp_path):
    """A clip longer than the frames left after its anchor is cut there (as an AUDIO guide is), instead of
    being read whole and refused as too long to fit."""
    from h3_core.guides import GuideFile, check_guide, clip_room, read_guide
    from h3_core.media_write import write_mp4

    assert [clip_room(i, 107) for i in (0, 60, 106, -1, -47, 200, -300)] == [107, 47, 1, 1, 47, 1, 107]
    path = tmp_path / "long.mp4"
    write_mp4(path, np.zeros((240, 48, 64, 3), dtype=np.uint8), np.zeros((2, 32000 * 10), dtype=np.float32))
    frames, sound, rate = read_guide(GuideFile(60, "video", path), 107)
    assert frames.shape[0] == 47 and sound.shape[1] == round(47 / 24 * rate)
    pixels, anchor, _ = check_guide("t2va", 107, 60, frames, sound, rate)
    assert (pixels.shape[0], anchor) == (47, 60)  # 39 of them (17n + 5) are anchored
    assert read_guide(GuideFile(-47, "video", path), 107)[0].shape[0] == 47
    assert read_guide(GuideFile(60, "video", path), 974, clip_frames=22)[0].shape[0] == 22


def test_a_guide_file_is_read_no_longer_than_a_sampled_window(tmp_path, monkeypatch):
    """Continuing a clip longer than any window: a guide video file is read at most as far as the longest window
    made (a clip must end in its window), not as far as the clip being continued (its frames held, then refused)."""
    from h3_core import geometry, media_read
    from h3_core.cli import main
    from h3_core.output import AVLatents

    frames = 294  # longer than the 277-frame windows
    AVLatents(torch.randn(1, 24, geometry.latent_frames(frames), 8, 14),
              torch.randn(2, 32, geometry.audio_latents(frames))).save(tmp_path / "given.safetensors")
    (tmp_path / "guide.mp4").write_bytes(b"read by the stand-in")
    asked = []

    class Stopped(Exception):
        pass

    def read_video(path, start, max_frames=None, **kwargs):
        asked.append(max_frames)
        raise Stopped

    monkeypatch.setattr(media_read, "read_video", read_video)
    with pytest.raises(Stopped):
        main(["generate", "--long-video", "--duration", "40", "--continue-from", str(tmp_path / "given.safetensors"),
              "--guide", f"{frames}:video={tmp_path / 'guide.mp4'}", "--prompt", "x", "--steps", "2",
              "--save-latents", str(tmp_path / "out.safetensors")])
    assert asked == [277]
