"""The streamed video decode over several devices (issue #11): its temporal clips are independent, so
they are decoded on several devices at once (a replica and a thread each) and stitched in order.
On CPU "devices" the frames must be bitwise those of the single-device stream, in order, with a
bounded number of clips in flight, and a worker's error must surface as itself."""

import dataclasses
import threading
import time

import pytest
import torch

from h3_core import output, pipeline
from h3_core.conditioning import Request
from h3_core.tiny import tiny_random_video_vae
from h3_core.vae_video import VideoVAE, replicate

CLIPS = 6  # L = 5 * 6 + 2 latents: six 7-latent decode clips


@pytest.fixture(scope="module")
def vae():
    return tiny_random_video_vae()


def raw_latents(vae, latent_frames=5 * CLIPS + 2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vae.config.latent_channels, latent_frames, 4, 6, generator=g)


def clip_index(clip: torch.Tensor) -> int:
    """Which decode clip this is: clips are views starting at latent 5i of the (padded) latents."""
    return clip.storage_offset() // (clip.stride(2) * 5)


class Watch:
    """Wraps VideoVAE._decode_clip: counts started and concurrently running clip decodes, can delay
    or fail a clip by index."""

    def __init__(self, delay=lambda index: 0.0, fail=None):
        self.real = VideoVAE._decode_clip
        self.delay, self.fail = delay, fail
        self.lock = threading.Lock()
        self.started, self.running, self.most = [], 0, 0

    def __call__(self, model, clip, tiled):
        index = clip_index(clip)
        with self.lock:
            self.started.append(index)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.delay(index))
            if self.fail is not None and index == self.fail[0]:
                raise self.fail[1]
            return self.real(model, clip, tiled)
        finally:
            with self.lock:
                self.running -= 1


def install(monkeypatch, watch: Watch) -> None:
    monkeypatch.setattr(VideoVAE, "_decode_clip", lambda model, clip, tiled: watch(model, clip, tiled))


def decode_threads():
    return [t for t in threading.enumerate() if t.name.startswith("h3-vae-decode")]


@pytest.mark.parametrize("count", [2, 3])
def test_devices_give_the_single_device_blocks_bitwise_in_order(vae, monkeypatch, count):
    latents = raw_latents(vae)
    expected = list(vae.decode_stream(latents))
    # clip 0 is the slowest, so later clips finish first and must wait to be stitched in order
    watch = Watch(delay=lambda index: 0.15 if index == 0 else 0.01)
    install(monkeypatch, watch)
    got = list(vae.decode_stream(latents, devices=["cpu"] * count))
    assert sorted(watch.started) == list(range(CLIPS))
    assert [b.shape for b in got] == [b.shape for b in expected] and len(got) == CLIPS + 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not decode_threads()


def test_padded_latents_decode_the_same(vae):
    latents = raw_latents(vae, latent_frames=13)  # padded by 4 latents to 3 clips
    expected = list(vae.decode_stream(latents))
    got = list(vae.decode_stream(latents, devices=["cpu", "cpu"]))
    assert [b.shape[2] for b in got] == [b.shape[2] for b in expected]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("count", [2, 3])
def test_clips_in_flight_are_bounded(vae, monkeypatch, count):
    """At most one clip runs per device, and when block j reaches the consumer at most j + count + 1
    clips have started: the decode runs ahead of the writer by a fixed number of clips."""
    watch = Watch(delay=lambda index: 0.05)
    install(monkeypatch, watch)
    started_at_block = []
    for _ in vae.decode_stream(raw_latents(vae), devices=["cpu"] * count):
        started_at_block.append(len(watch.started))
        time.sleep(0.1 if len(started_at_block) <= 2 else 0.0)  # a slow writer: unbounded, the decode would run ahead
    assert watch.most == count  # every device busy at once, never more than one clip each
    assert all(started <= j + count + 1 for j, started in enumerate(started_at_block[:CLIPS]))
    assert started_at_block[0] < CLIPS


def test_a_worker_error_surfaces_as_itself(vae, monkeypatch):
    error = RuntimeError("CUDA out of memory on clip 2 (simulated)")
    install(monkeypatch, Watch(fail=(2, error)))
    received = []
    with pytest.raises(RuntimeError) as caught:
        for block in vae.decode_stream(raw_latents(vae), devices=["cpu", "cpu"]):
            received.append(block)
    assert caught.value is error
    assert len(received) == 2  # the blocks before the failed clip came out
    assert not decode_threads()


def test_closing_the_stream_early_stops_the_threads(vae, monkeypatch):
    watch = Watch(delay=lambda index: 0.02)
    install(monkeypatch, watch)
    stream = vae.decode_stream(raw_latents(vae), devices=["cpu", "cpu", "cpu"])
    next(stream)
    stream.close()
    assert not decode_threads() and len(watch.started) < CLIPS


def test_replica_copies_tensors_straight_to_the_device(vae):
    model = VideoVAE.build(vae.config, dtype=torch.bfloat16)
    on_meta = replicate(model, "meta")  # nothing is allocated: each tensor went straight to "meta"
    assert on_meta is not model and on_meta.config == model.config
    pairs = list(zip(model.named_parameters(), on_meta.named_parameters()))
    assert all(n == m and q.device.type == "meta" and q.dtype == p.dtype and p.device.type == "cpu"
               for (n, p), (m, q) in pairs)
    same = replicate(vae, "cpu")  # the same device shares the weights
    assert same is not vae and all(p.data_ptr() == q.data_ptr() for p, q in zip(vae.parameters(), same.parameters()))
    latents = raw_latents(vae, latent_frames=7)
    assert torch.equal(same.decode(latents), vae.decode(latents))


def test_decode_video_and_write_mp4_take_devices(tmp_path, vae, monkeypatch):
    latents = raw_latents(vae, latent_frames=12)
    blocks = list(output.decode_video(vae, latents, devices=["cpu", "cpu"]))
    assert torch.equal(torch.cat(blocks), torch.cat(list(output.decode_video(vae, latents))))

    seen = []
    real = output.decode_video
    monkeypatch.setattr(output, "decode_video",
                        lambda v, z, devices=None, tiled=None: seen.append((devices, tiled)) or real(v, z, devices, tiled))
    from h3_core.tiny import tiny_random_audio_vae
    from h3_core import geometry

    av = output.AVLatents(latents, torch.zeros(2, 32, geometry.audio_latents(39)))
    output.write_mp4(tmp_path / "a.mp4", av, vae, tiny_random_audio_vae(), devices=["cpu", "cpu"], tiled=False)
    assert seen == [(["cpu", "cpu"], False)] and (tmp_path / "a.mp4").stat().st_size > 0


def test_generate_passes_its_devices_to_the_decode(tmp_path, monkeypatch):
    """With settings.devices the decode gets them (the DiT is run here on one device, to stay fast)."""
    decodes = []
    monkeypatch.setattr(pipeline, "write_mp4", lambda *a, **k: decodes.append(k.get("devices")))
    real_load = pipeline.load_sampling_dit
    monkeypatch.setattr(pipeline, "load_sampling_dit", lambda source, dit_source, partition, settings, *rest: real_load(
        source, dit_source, partition, dataclasses.replace(settings, devices=()), *rest))
    request = Request("t2va", "a fox on the beach", duration=4)
    for devices in (("cpu",), ("cpu", "cpu")):
        pipeline.generate(request, "tiny-random", pipeline.GenerateSettings(steps=2, devices=devices),
                          out=tmp_path / "a.mp4")
    assert decodes == [None, ("cpu", "cpu")]
