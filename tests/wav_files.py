"""WAV files the tests write: a stereo pair of tones (220 Hz left, 330 Hz right) of a given length."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def write_wav(path, seconds: float, rate: int = 16000) -> Path:
    time = np.arange(int(seconds * rate)) / rate
    stereo = np.stack([np.sin(2 * np.pi * 220 * time), np.sin(2 * np.pi * 330 * time)], axis=1)
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(2)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes((0.5 * stereo * 32767).astype("<i2").tobytes())
    return Path(path)
