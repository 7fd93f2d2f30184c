"""A run of several outputs decodes each while the DiT stays for the next only where the decode fits beside it
(the DiT's plan does not count the VAEs); else the decodes wait, their latents on the CPU, until the DiT has
left. Either way the VAEs leave the device again before the DiT samples, and the MP4s and results are the
same, in job and seed order."""

import torch

from h3_core import pipeline
from h3_core.conditioning import Request
from h3_core.memory_plan import GIB, usable_bytes
from h3_core.output import AVLatents
from h3_core.placement import module_bytes
from h3_core.tiny import tiny_random_audio_vae, tiny_random_video_vae
from h3_core.vae_video import VideoVAE, decode_working_bytes

SETTINGS = pipeline.GenerateSettings(steps=2, dtype=torch.float32, seed=5)


def run_batch(tmp_path, monkeypatch, fits: bool):
    """Two jobs (two outputs, then one) with the decode said to fit beside the DiT or not; the events in order:
    ("sample",), ("vae to",), ("release",), ("write", name)."""
    events, notes = [], []
    real_sample, real_release, real_write, real_to = (pipeline.sample, pipeline._release_dit, pipeline.write_mp4,
                                                      VideoVAE.to)
    with monkeypatch.context() as patch:  # this run's wrappers only
        patch.setattr(pipeline, "decode_fits_beside_dit", lambda *args: fits)
        patch.setattr(pipeline, "sample", lambda *a, **k: events.append(("sample",)) or real_sample(*a, **k))
        patch.setattr(pipeline, "_release_dit", lambda *a: events.append(("release",)) or real_release(*a))
        patch.setattr(pipeline, "write_mp4", lambda path, *a, **k: events.append(("write", path.name))
                      or real_write(path, *a, **k))
        patch.setattr(VideoVAE, "to", lambda self, *a, **k: events.append(("vae to",)) or real_to(self, *a, **k))
        folder = tmp_path / ("fits" if fits else "waits")
        jobs = [pipeline.Job(Request("t2va", prompt="a fox on the beach", duration=4), out=folder / "fox.mp4", outputs=2),
                pipeline.Job(Request("t2va", prompt="rain on a tin roof", duration=4), out=folder / "rain.mp4", seed=9)]
        results = pipeline.generate_batch(jobs, "tiny-random", SETTINGS, notes=notes.append)
    return results, events, notes


def test_decodes_that_do_not_fit_beside_the_dit_wait_until_it_has_left(tmp_path, monkeypatch):
    beside, beside_events, _ = run_batch(tmp_path, monkeypatch, fits=True)
    waited, events, notes = run_batch(tmp_path, monkeypatch, fits=False)
    samples = [n for n, event in enumerate(events) if event == ("sample",)]
    writes = [n for n, event in enumerate(events) if event[0] == "write"]
    assert len(samples) == 3 and events.index(("release",)) > samples[-1]
    assert events.index(("release",)) < writes[0]  # every decode after the DiT left
    assert [events[n][1] for n in writes] == ["fox_00000.mp4", "fox_00001.mp4", "rain.mp4"]
    assert [(r.seed, r.video_path.name) for r in waited] == [(5, "fox_00000.mp4"), (6, "fox_00001.mp4"), (9, "rain.mp4")]
    assert [(r.seed, r.video_path.name) for r in beside] == [(r.seed, r.video_path.name) for r in waited]
    for ours, theirs in zip(waited, beside):
        assert torch.equal(ours.latents.video, theirs.latents.video) and torch.equal(ours.latents.audio, theirs.latents.audio)
        assert ours.video_path.stat().st_size > 0 and ours.latents.video.device.type == "cpu"
    assert any("a decode did not fit beside the DiT; 3 output(s) decoded after it left" in line for line in notes), notes

    # beside the DiT: each decode right after its sampling, and the VAEs leave the device before the next one
    samples = [n for n, event in enumerate(beside_events) if event == ("sample",)]
    writes = [n for n, event in enumerate(beside_events) if event[0] == "write"]
    assert samples[0] < writes[0] < samples[1] < writes[1] < samples[2] < writes[2]
    for write, next_sample in zip(writes, samples[1:]):
        assert ("vae to",) in beside_events[write + 1:next_sample], str(beside_events)


def test_a_decode_fits_beside_the_dit_within_what_is_free_and_the_budget(monkeypatch):
    """On a GPU: both VAEs' weights and the decode's working memory against what is free and, with gpu_memory,
    the budget less what this process holds."""
    video_vae, audio_vae = tiny_random_video_vae(), tiny_random_audio_vae()
    latents = AVLatents(torch.zeros(1, video_vae.config.latent_channels, 7, 4, 6), torch.zeros(1, 8, 20))
    need = module_bytes([video_vae, audio_vae]) + decode_working_bytes(video_vae.config, 7, 4, 6, 4)
    cuda = torch.device("cuda")
    free, allocated = [2**50], [0]
    monkeypatch.setattr(pipeline, "free_bytes", lambda device: free[0])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated[0])

    def fits(gpu_memory=None):
        settings = pipeline.GenerateSettings(gpu_memory=gpu_memory)
        return pipeline.decode_fits_beside_dit(video_vae, audio_vae, latents, settings, cuda)

    assert fits() and pipeline.decode_fits_beside_dit(video_vae, audio_vae, latents, SETTINGS, torch.device("cpu"))
    free[0] = 0
    assert not fits()
    free[0], budget = 2**50, 24
    allocated[0] = usable_bytes(budget * GIB) - need
    assert fits(budget)
    allocated[0] += 1
    assert not fits(budget)
