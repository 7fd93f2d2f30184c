"""Where a long video stood after a finished window: saved with the clip so far (AVLatents.resume), so that a
run continued from that file with the same seed makes what the run would have made had it not stopped.

It holds what the finished windows fixed and a continued run cannot rebuild from the clip alone: the request
generator's state after their draws, and the media clock (the longest window prompt, finished windows' included).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import torch

METADATA_KEY = "h3_long_video_resume"


@dataclass(frozen=True)
class ResumePoint:
    seed: int
    generator_state: torch.Tensor  # torch.Generator("cpu").get_state(): uint8
    media_origin: float
    frames: int  # pixel frames of the clip it was saved with

    def __repr__(self) -> str:  # printed among a latent's facts: not the generator's 5056 bytes
        return f"ResumePoint(seed={self.seed}, frames={self.frames}, media_origin={self.media_origin:g})"

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata entry that carries it (text only)."""
        state = base64.b64encode(self.generator_state.numpy().tobytes()).decode("ascii")
        return {METADATA_KEY: json.dumps({"seed": self.seed, "generator": state, "media_origin": self.media_origin,
                                          "frames": self.frames})}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, source: str) -> ResumePoint | None:
        """The point a file's metadata holds, None if it holds none; a clear error for one that cannot be read."""
        text = (metadata or {}).get(METADATA_KEY)
        if text is None:
            return None
        try:
            fields = json.loads(text)
            state = torch.frombuffer(bytearray(base64.b64decode(fields["generator"], validate=True)), dtype=torch.uint8)
            point = cls(int(fields["seed"]), state, float(fields["media_origin"]), int(fields["frames"]))
            torch.Generator("cpu").set_state(point.generator_state)
        except (ValueError, TypeError, KeyError, RuntimeError) as error:
            raise ValueError(f"{source}: its '{METADATA_KEY}' metadata (where a stopped long video resumes) cannot "
                             f"be read ({type(error).__name__}: {error}); it was changed after h3 generate wrote "
                             "it.") from None
        return point
