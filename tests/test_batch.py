"""`h3 generate --batch FILE`: many requests, each model loaded once; every job equals its own h3 generate run,
and a bad batch is refused, naming the line, before any model loads."""

import re
import shlex

import pytest
import torch
from safetensors.torch import load_file

from h3_core import pipeline
from h3_core.cli import main

SHARED = ["--steps", "3", "--device", "cpu"]


def test_a_batch_equals_its_jobs_run_one_by_one_and_loads_each_model_once(tmp_path, monkeypatch, capsys):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(
        "# two requests and a pair of seeds\n"
        f"--prompt 'a fox on the beach' --seed 3 --save-latents {tmp_path}/fox.safetensors --out {tmp_path}/fox.mp4\n"
        "\n"
        f"--prompt 'rain on a tin roof' --duration 4 --aspect-ratio 1:1 --outputs 2 --save-latents {tmp_path}/rain.safetensors\n"
    )
    loads = {"text encoder": 0, "DiT": 0}
    for name, what in (("load_text_encoder_for", "text encoder"), ("load_sampling_dit", "DiT")):
        real = getattr(pipeline, name)
        monkeypatch.setattr(pipeline, name, lambda *a, _real=real, _what=what, **k:
                            loads.__setitem__(_what, loads[_what] + 1) or _real(*a, **k))
    assert main(["generate", "--batch", str(jobs), "--duration", "5", *SHARED]) == 0
    assert loads == {"text encoder": 1, "DiT": 1}
    printed = capsys.readouterr().out
    assert re.search(r"fox.mp4: t2va, seed 3, 124 frames", printed)  # the command line's --duration 5
    assert re.search(r"rain_00001.safetensors: t2va, seed 1, 107 frames", printed)

    alone = tmp_path / "alone"
    singles = [
        (["--prompt", "a fox on the beach", "--seed", "3", "--duration", "5"], ["fox.safetensors"]),
        (["--prompt", "rain on a tin roof", "--duration", "4", "--aspect-ratio", "1:1", "--outputs", "2"],
         ["rain_00000.safetensors", "rain_00001.safetensors"]),
    ]
    for options, names in singles:
        stem = names[0].split("_")[0].removesuffix(".safetensors")
        assert main(["generate", *options, *SHARED, "--save-latents", str(alone / f"{stem}.safetensors")]) == 0
        for name in names:
            ours, theirs = load_file(str(tmp_path / name)), load_file(str(alone / name))
            assert torch.equal(ours["video"], theirs["video"]) and torch.equal(ours["audio"], theirs["audio"]), name
    assert (tmp_path / "fox.mp4").stat().st_size > 0


@pytest.mark.parametrize("lines, message", [
    (["--prompt x --model tiny-random --out {tmp}/a.mp4"], r"line 1: --model applies to the whole batch; give it on the command line"),
    (["--prompt x --out {tmp}/a.mp4", "--prompt y --steps 8 --lora a.safetensors --out {tmp}/b.mp4"],
     r"line 2: --steps, --lora apply to the whole batch; give them on the command line"),
    (["--prompt x --out {tmp}/a.mp4", "--prompt y --out {tmp}/a.mp4"], r"--batch \S*jobs.txt, lines 1 and 2 both write \S*a.mp4"),
    (["--prompt x --out {tmp}/a.mp4", "--task ref2va --ref image={tmp}/i.png --prompt y --out {tmp}/b.mp4"],
     "A batch runs one DiT"),
    (["--prompt x --out {tmp}/a.mp4", "--prompt 'unclosed --out {tmp}/b.mp4"], r"line 2: not the request options"),
    (["--prompt x --out {tmp}/a.mp4", "--prompt x --duration 99 --out {tmp}/b.mp4"],
     r"line 2: The duration must be between 4 and 15 seconds, got 99"),
    (["--prompt x"], r"line 1: Give --out"),
    (["# nothing", ""], "holds no jobs"),
])
def test_a_bad_batch_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys, lines, message):
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "i.png")
    for name in ("load_text_encoder_for", "load_vaes", "load_sampling_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))
    jobs = tmp_path / "jobs.txt"
    jobs.write_text("\n".join(line.format(tmp=tmp_path) for line in lines) + "\n")
    assert main(["generate", "--batch", str(jobs), *SHARED]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error


def test_the_readme_batch_file_reads_as_its_jobs(tmp_path):
    """The README's jobs.txt: three jobs; a line's options override the command line's, the rest come from it."""
    from pathlib import Path

    from h3_core.cli import _batch_jobs, build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("```text\n# jobs.txt\n", 1)[1].split("```", 1)[0]
    jobs_file = tmp_path / "jobs.txt"
    jobs_file.write_text(block)
    args = build_parser().parse_args(["generate", "--batch", str(jobs_file), "--duration", "5", "--seed", "7"])
    fox, rain, door = _batch_jobs(args)
    assert (fox.request.duration, fox.seed, fox.outputs, str(fox.out)) == (5.0, 1, 1, "out/fox.mp4")
    assert (rain.request.duration, rain.seed, rain.outputs) == (8.0, 7, 2)
    assert door.request.task == "fl2va" and door.request.first_image == Path("a.png") and door.request.duration == 5.0
    assert fox.name.endswith("line 1") and door.name.endswith("line 3")


def test_a_batch_lines_canvas_or_kept_clip_replaces_the_command_lines_canvas_and_length(tmp_path):
    """A line's --aspect-ratio replaces the command line's --width/--height (and the reverse), and a line keeping a
    clip (--keep, --from) takes the clip's canvas and length over the command line's --duration and canvas: the
    README's batch command gives those to every job (they had been refused as given twice)."""
    import torch

    from h3_core.cli import _batch_jobs, build_parser
    from h3_core.output import AVLatents

    AVLatents(torch.zeros(1, 24, 37, 2, 4), torch.zeros(2, 32, 207)).save(tmp_path / "mine.safetensors")
    jobs_file = tmp_path / "jobs.txt"
    jobs_file.write_text("--prompt a --out a.mp4\n"
                         "--prompt b --aspect-ratio 1:1 --out b.mp4\n"
                         f"--prompt c --keep video --from {tmp_path / 'mine.safetensors'} --out c.mp4\n")
    args = build_parser().parse_args(["generate", "--batch", str(jobs_file), "--duration", "5", "--width", "256",
                                      "--height", "128"])
    plain, square, kept = _batch_jobs(args)
    assert (plain.request.width, plain.request.height, plain.request.aspect_ratio, plain.request.duration) == (256, 128, None, 5)
    assert (square.request.width, square.request.height, square.request.aspect_ratio) == (None, None, "1:1")
    assert square.request.duration == 5
    assert (kept.keep, kept.request.width, kept.request.height, kept.request.num_frames) == ("video", 64, 32, 124)
    args = build_parser().parse_args(["generate", "--batch", str(jobs_file), "--aspect-ratio", "9:16"])
    jobs_file.write_text("--prompt a --width 64 --height 128 --out a.mp4\n--prompt b --out b.mp4\n")
    tall, inherited = _batch_jobs(args)
    assert (tall.request.width, tall.request.height, tall.request.aspect_ratio) == (64, 128, None)
    assert inherited.request.aspect_ratio == "9:16"


def test_a_long_video_and_a_guided_job_in_one_batch_equal_their_own_runs(tmp_path):
    """Jobs of other kinds share the loaded models too: a long video (windows) and a request with a guide
    image give, in one batch, the latents each gives alone."""
    from PIL import Image

    Image.new("RGB", (96, 64), (200, 40, 10)).save(tmp_path / "red.png")
    long_job = ["--prompt", "waves", "--long-video", "--duration", "9", "--window-frames", "107",
                "--overlap-frames", "22", "--seed", "5"]
    guided = ["--prompt", "a red card", "--guide", f"0:image={tmp_path}/red.png", "--duration", "4"]
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(shlex.join(long_job) + f" --save-latents {tmp_path}/long.safetensors\n"
                    + shlex.join(guided) + f" --save-latents {tmp_path}/guided.safetensors\n")
    assert main(["generate", "--batch", str(jobs), "--steps", "2", "--device", "cpu"]) == 0
    for options, name in ((long_job, "long"), (guided, "guided")):
        alone = tmp_path / f"{name}_alone.safetensors"
        assert main(["generate", *options, "--steps", "2", "--device", "cpu", "--save-latents", str(alone)]) == 0
        ours, theirs = load_file(str(tmp_path / f"{name}.safetensors")), load_file(str(alone))
        assert torch.equal(ours["video"], theirs["video"]) and torch.equal(ours["audio"], theirs["audio"]), name
    assert load_file(str(tmp_path / "long.safetensors"))["video"].shape[2] > 30  # 9 s: more than one window's


def test_a_batch_comment_runs_from_a_hash_that_starts_a_word_as_in_a_shell(tmp_path):
    from h3_core.cli import _batch_jobs, build_parser

    jobs_file = tmp_path / "jobs.txt"
    jobs_file.write_text('--prompt "shot #2" --out take#2.mp4 --seed 4  # the second take\n'
                         "  # only a comment\n"
                         r"--prompt a\ #b --out b.mp4 --seed 5 #--seed 6" "\n")
    args = build_parser().parse_args(["generate", "--batch", str(jobs_file)])
    shot, escaped = _batch_jobs(args)
    assert (shot.request.prompt, str(shot.out), shot.seed) == ("shot #2", "take#2.mp4", 4)
    assert (escaped.request.prompt, escaped.seed) == ("a #b", 5)


def test_a_tilde_in_a_batch_lines_output_is_the_home_folder(tmp_path, monkeypatch):
    """No shell expands `~` in a batch line: the output is written where it was checked, in the home folder, not
    in a folder named ~."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    jobs = tmp_path / "jobs.txt"
    jobs.write_text('--prompt "a fox" --save-latents ~/fox.safetensors\n')
    assert main(["generate", "--batch", str(jobs), "--steps", "2", "--duration", "4"]) == 0
    assert (tmp_path / "home" / "fox.safetensors").is_file() and not (tmp_path / "~").exists()


def test_a_batch_file_with_a_byte_order_mark_reads_and_other_encodings_are_named(tmp_path):
    """Windows editors start UTF-8 files with a byte-order mark: line 1 still reads. A UTF-16 file (PowerShell's
    `>`) is refused naming the file and what to do."""
    from h3_core.cli import _batch_jobs, build_parser

    line = '--prompt "a fox" --out out/fox.mp4\n'
    marked, wide = tmp_path / "marked.txt", tmp_path / "wide.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + line.encode())
    wide.write_text(line, encoding="utf-16")
    (job,) = _batch_jobs(build_parser().parse_args(["generate", "--batch", str(marked)]))
    assert job.request.prompt == "a fox"
    with pytest.raises(ValueError, match=r"wide.txt is not UTF-8 text \(byte 0\); save it as UTF-8"):
        _batch_jobs(build_parser().parse_args(["generate", "--batch", str(wide)]))
    with pytest.raises(ValueError, match="a folder; give the jobs file"):
        _batch_jobs(build_parser().parse_args(["generate", "--batch", str(tmp_path)]))
