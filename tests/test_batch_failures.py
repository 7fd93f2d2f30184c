"""A --batch job that fails while the batch runs (a sampling, decode or write error) is said, its memory handed
back, and the batch goes on with the next job; the command then names it and exits 1. An interrupt still
stops the batch at once, and a lone `h3 generate` (or generate_batch without on_failure) raises as before."""

import re

import pytest
import torch

from h3_core import pipeline
from h3_core.cli import main
from h3_core.conditioning import Request, RequestError

SHARED = ["--steps", "2", "--duration", "4", "--device", "cpu"]


def write_jobs(tmp_path, names=("a", "b", "c")):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("".join(f"--prompt 'clip {name}' --seed {n} --out {tmp_path}/{name}.mp4\n"
                            for n, name in enumerate(names)))
    return jobs


def fail_on(monkeypatch, name, error, when):
    """pipeline.`name` raises `error` for the calls `when(args)` picks; the others run the real one."""
    real = getattr(pipeline, name)

    def failing(*args, **kwargs):
        if when(args):
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, name, failing)


def test_a_job_that_fails_is_named_and_the_batch_goes_on(tmp_path, monkeypatch, capsys):
    events = []

    def job_b(args):
        if args[0].name == "b.mp4":
            events.append("failed")
            return True
        return False

    fail_on(monkeypatch, "write_mp4", RuntimeError("boom"), job_b)
    monkeypatch.setattr(pipeline, "empty_caches", lambda device=None: events.append("freed"))
    assert main(["generate", "--batch", str(write_jobs(tmp_path)), *SHARED]) == 1
    assert (tmp_path / "a.mp4").stat().st_size > 0 and (tmp_path / "c.mp4").stat().st_size > 0
    assert not (tmp_path / "b.mp4").exists()
    assert events[events.index("failed") + 1] == "freed"  # its memory handed back before the next job
    printed = capsys.readouterr()
    assert re.search(r"a\.mp4: t2va, seed 0", printed.out) and re.search(r"c\.mp4: t2va, seed 2", printed.out)
    assert "b.mp4: t2va" not in printed.out
    # said when it happens, and again in the summary
    assert re.search(r"h3: --batch .*jobs\.txt, line 2 \(.*b\.mp4\) failed: RuntimeError: boom; the batch goes on",
                     printed.err), printed.err
    assert "h3: 2 of 3 jobs done, 1 failed:" in printed.err
    assert re.search(r"h3:   --batch .*jobs\.txt, line 2 \(.*b\.mp4\): RuntimeError: boom\n", printed.err)


@pytest.mark.parametrize("stage, error", [
    ("encode_request", RequestError("clip b cannot be encoded")),
    ("sample", torch.cuda.OutOfMemoryError("CUDA out of memory (boom)")),
])
def test_generate_batch_hands_each_failure_to_on_failure_and_returns_the_others(tmp_path, monkeypatch, stage, error):
    """Through the API: the failed job (its encode or its sampling) has no results, the others theirs in job
    order; the failing call's frame lets go of what it held (its conditioning, the DiT) though the error is
    kept."""
    calls = []
    fail_on(monkeypatch, stage, error, lambda args: calls.append(1) or len(calls) == 2)
    jobs = [pipeline.Job(Request("t2va", prompt=f"clip {n}", duration=4), save_latents=tmp_path / f"{n}.safetensors")
            for n in "abc"]
    failures, notes = [], []
    results = pipeline.generate_batch(jobs, "tiny-random", pipeline.GenerateSettings(steps=2, dtype=torch.float32),
                                      notes=notes.append, on_failure=lambda *failure: failures.append(failure))
    assert [result.latents_path.name for result in results] == ["a.safetensors", "c.safetensors"]
    assert not (tmp_path / "b.safetensors").exists()
    assert failures == [("job 2", jobs[1], error)]
    assert any(re.fullmatch(rf"job 2 \(.*b\.safetensors\) failed: {type(error).__name__}: {re.escape(str(error))}; "
                            "the batch goes on with the next job", line) for line in notes), notes
    trace = error.__traceback__
    while trace.tb_next is not None:
        trace = trace.tb_next
    assert trace.tb_frame.f_code.co_name == "failing" and trace.tb_frame.f_locals == {}


def test_an_interrupt_stops_the_batch_at_once(tmp_path, monkeypatch):
    calls = []
    fail_on(monkeypatch, "sample", KeyboardInterrupt(), lambda args: calls.append(1) or len(calls) == 2)
    assert main(["generate", "--batch", str(write_jobs(tmp_path)), *SHARED]) == 130  # h3: stopped
    assert (tmp_path / "a.mp4").stat().st_size > 0
    assert not (tmp_path / "b.mp4").exists() and not (tmp_path / "c.mp4").exists()


def test_a_lone_generate_still_raises_its_error(tmp_path, monkeypatch):
    fail_on(monkeypatch, "write_mp4", RuntimeError("boom"), lambda args: True)
    with pytest.raises(RuntimeError, match="boom"):
        main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), *SHARED])


def test_a_batch_that_succeeds_exits_0_with_no_summary(tmp_path, capsys):
    assert main(["generate", "--batch", str(write_jobs(tmp_path)), *SHARED]) == 0
    assert all((tmp_path / f"{name}.mp4").stat().st_size > 0 for name in "abc")
    printed = capsys.readouterr()
    assert len(re.findall(r"\.mp4: t2va, seed \d", printed.out)) == 3
    assert "failed" not in printed.err and "jobs done" not in printed.err


def test_a_last_job_that_fails_still_lets_the_dit_go(tmp_path, monkeypatch):
    """The DiT is let go before the last job's decode; when that job fails sampling, it is let go after it."""
    calls, released = [], []
    fail_on(monkeypatch, "sample", RuntimeError("boom"), lambda args: calls.append(1) or len(calls) == 2)
    real = pipeline._release_dit
    monkeypatch.setattr(pipeline, "_release_dit", lambda dit, *rest: released.append(dit) or real(dit, *rest))
    jobs = [pipeline.Job(Request("t2va", prompt=f"clip {n}", duration=4), save_latents=tmp_path / f"{n}.safetensors")
            for n in "ab"]
    results = pipeline.generate_batch(jobs, "tiny-random", pipeline.GenerateSettings(steps=2, dtype=torch.float32),
                                      on_failure=lambda *failure: None)
    assert [result.latents_path.name for result in results] == ["a.safetensors"]
    assert len(released) == 1 and released[0] is not None


def live(kind) -> int:
    import gc

    gc.collect()
    return sum(isinstance(thing, kind) for thing in gc.get_objects())


@pytest.mark.parametrize("collect", [False, True], ids=["raised", "on_failure"])
def test_an_error_kept_by_the_caller_keeps_no_model(tmp_path, collect):
    """A script or notebook keeps the last error (sys.last_value, a log of failures): it must not keep the
    run's DiT (its device memory, a multi-GPU run's worker processes), VAEs or text encoder with it."""
    from h3_core.dit import H3DiT
    from h3_core.text import TextEncoder
    from h3_core.vae_video import VideoVAE

    def fail_sampling(stage, done, total):
        if stage.startswith("sample") and done == 1:
            raise RuntimeError("boom")

    jobs = [pipeline.Job(Request("t2va", prompt=f"clip {n}", duration=4), out=tmp_path / f"{n}.mp4") for n in "ab"]
    settings = pipeline.GenerateSettings(steps=3, dtype=torch.float32)
    kept = []
    if collect:
        assert pipeline.generate_batch(jobs, "tiny-random", settings, progress=fail_sampling,
                                       on_failure=lambda name, job, error: kept.append(error)) == []
    else:
        with pytest.raises(RuntimeError, match="boom") as raised:
            pipeline.generate_batch(jobs, "tiny-random", settings, progress=fail_sampling)
        kept.append(raised.value)
    assert len(kept) == (2 if collect else 1)
    assert (live(H3DiT), live(VideoVAE), live(TextEncoder)) == (0, 0, 0)
