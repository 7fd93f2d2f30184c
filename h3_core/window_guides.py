"""Guides in a long video: each one given to the windows that make the frames it anchors.

A guide's frame index counts frames of the whole clip. Every window makes its "new part": the frames after
the overlap it repeats from the window before ([0, end) for the first window), and the new parts tile the
clip. So:
- an image or clip goes to the window whose new part holds its first frame, and must end inside that
  window (a clip crossing a window's end is refused with where the windows end);
- a sound goes to every window whose new part it reaches, each window its own slice of the sound's
  latents, cut where the next window's new part starts, so the sound is heard once, end to end.
Inside a window a guide is an ordinary guide (guides.py) at its local frame, packed after the latent
tail. A guide never lands in a window's overlap, which the latent tail already conditions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .conditioning import RequestError
from .continuation import Window, sampled
from .guides import GuideMedia, check_guide, encode_guide, guide_frame_count
from .layout import FRAME_TIME, GuideBlock


@dataclass(frozen=True)
class WindowGuide:
    """One guide's share of one window: its layout block (local frame index) and latents (video
    [1, C, L, h, w] or None, sound [2, Ca, A] or None)."""

    window: int
    block: GuideBlock
    video: torch.Tensor | None
    audio: torch.Tensor | None


def new_part_start(window: Window) -> int:
    """The first frame a window makes that no window before it made."""
    return window.start + window.overlap


def owning_window(windows: Sequence[Window], frame: int) -> Window:
    """The window whose new part holds `frame` of the whole clip."""
    for window in windows:
        if new_part_start(window) <= frame < window.end:
            return window
    raise RequestError(f"Frame {frame} is outside the clip's {windows[-1].end} frames.")


def check_window_guides(task: str, windows: Sequence[Window], num_frames: int, guides: Sequence[GuideMedia],
                        locked: str | None = None) -> list[tuple]:
    """Every check of a long video's guides that needs no model: per guide, `check_guide`'s (frames or None,
    frame of the clip, audio latents left), after checking that its image or clip ends in its window. `locked`:
    the modality the whole clip holds fixed ("audio": a driving track, "video": a kept clip), which no guide
    may carry."""
    checked = []
    for number, guide in enumerate(guides, 1):
        if not isinstance(guide, GuideMedia):
            raise RequestError(f"A long video takes its guides as guides.GuideMedia; guide {number} is a "
                               f"{type(guide).__name__}.")
        pixels, anchor, keep = check_guide(task, num_frames, guide.frame_index, guide.frames, guide.waveform,
                                           guide.sample_rate)
        if windows[0].given and anchor < windows[0].end:
            raise RequestError(f"Guide {number} anchors frame {anchor}, inside the clip being continued (frames "
                               f"0-{windows[0].end - 1}), which is kept as it is; anchor it at frame "
                               f"{windows[0].end} or later.")
        if guide.waveform is not None and locked == "audio":
            raise RequestError(f"Guide {number} holds a sound, but a driving soundtrack fixes the whole clip's "
                               "audio; give the sound in the driving track or drop it from the guide.")
        if guide.frames is not None and locked == "video":
            raise RequestError(f"Guide {number} holds a picture, but the kept clip fixes the whole clip's video; "
                               "only sounds can guide it.")
        if pixels is not None:
            count = guide_frame_count(pixels.shape[0])
            window = owning_window(windows, anchor)
            if anchor + count > window.end:
                made = sampled(windows)  # numbered as window prompts and progress number them
                ends = ", ".join(str(w.end) for w in made)
                raise RequestError(
                    f"Guide {number}: its {count}-frame clip from frame {anchor} crosses the end of window "
                    f"{made.index(window) + 1} (frames {new_part_start(window)}-{window.end - 1} are made there); a "
                    f"clip must end in the window it starts in. The windows made end at frames {ends}: move the "
                    "clip, cut it, or change window_frames."
                )
        checked.append((pixels, anchor, keep))
    return checked


def sound_slices(windows: Sequence[Window], anchor: int, latents: int) -> list[tuple[Window, int, int, int]]:
    """(window, local frame, first latent, latent count) for each window a sound of `latents` latents
    anchored at clip frame `anchor` reaches. A window keeps at most what fits from its local frame to its
    end (as one request does) and stops where the next window's new part starts. Where a window's end could
    not hold the sound up to there (its whole latents end a fraction of one before), the next window's slice
    starts a frame early, in the overlap it does not keep, so no latent is left out."""
    slices, given = [], 0  # the sound's latents the windows so far hold
    for position, window in enumerate(windows):
        if given >= latents:  # all handed out: stepping a frame early would hand the last one out again
            break
        start = max(anchor, new_part_start(window))
        if start >= window.end:
            continue
        first = 0 if start == anchor else round(FRAME_TIME * (start - anchor))
        while first > given and start > max(anchor, window.start):
            start -= 1
            first = round(FRAME_TIME * (start - anchor))
        if first >= latents:
            break
        local = start - window.start
        stop = min(latents, first + math.floor(window.audio_latents - FRAME_TIME * local))
        if position + 1 < len(windows):
            stop = min(stop, round(FRAME_TIME * (window.end - anchor)))
        if stop > first:
            slices.append((window, local, first, stop - first))
            given = stop
    return slices


def encode_window_guides(task: str, windows: Sequence[Window], width: int, height: int, num_frames: int,
                         guides: Sequence[GuideMedia], video_vae=None, audio_vae=None,
                         locked: str | None = None, between_calls=None, after_each=None) -> list[WindowGuide]:
    """Every guide encoded once and shared out to its windows, in guide order; `between_calls()` before each
    and after each 17 frames of a clip (a host's interrupt check: a guide clip's encode is a VAE run of up to
    362 frames), `after_each()` once each is encoded (progress)."""
    shares = []
    checked = check_window_guides(task, windows, num_frames, guides, locked)
    for guide, (pixels, anchor, _) in zip(guides, checked):
        if between_calls is not None:
            between_calls()
        video, sound = encode_guide(pixels, guide.waveform, guide.sample_rate, width, height, num_frames,
                                    video_vae, audio_vae,
                                    None if between_calls is None else lambda done, total: between_calls())
        if after_each is not None:
            after_each()
        owner = owning_window(windows, anchor)
        slices = [] if sound is None else sound_slices(windows, anchor, sound.shape[-1])
        with_sound = {window.index: (local, first, count) for window, local, first, count in slices}
        if video is not None:
            local, first, count = with_sound.pop(owner.index, (anchor - owner.start, 0, 0))
            audio = sound[..., first:first + count] if count else None
            shares.append(WindowGuide(owner.index, GuideBlock(anchor - owner.start, video.shape[2], count), video,
                                      audio))
        for index, (local, first, count) in with_sound.items():
            shares.append(WindowGuide(index, GuideBlock(local, 0, count), None, sound[..., first:first + count]))
    return shares
