import argparse
import os
import struct
import subprocess
import sys

import pytest
import torch

import sublinear
from sublinear.tools.cli import build_parser, main

MLP_MODULE = '''import torch


def deep_mlp():
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def raises():
    raise RuntimeError("boom")


def not_a_module():
    return 3


def needs_width(width):
    return torch.nn.Linear(width, width)


class Tokens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.embed(ids)).sum(1)


def tokens():
    return Tokens()
'''
MLP = ["--model", "cli_test_models:deep_mlp", "--input-shape", "64,32"]  # activations outweigh parameters
TINY_HF = ["--model", "hf:BertForSequenceClassification", "--hidden", "32", "--seq", "16"]


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """The current directory holds cli_test_models.py and is not on sys.path, as for the console script."""
    (tmp_path / "cli_test_models.py").write_text(MLP_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cli_test_models", raising=False)
    return tmp_path


def one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for needle in needles:
        assert needle in err[0]
    return err[0]


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert main(["maxbatch", "--budget", "lots"]) == 2
    one_error_line(capsys, "not a size: 'lots'")
    assert main(["plan", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err


@pytest.mark.parametrize("argv,message", [
    (["maxbatch", "--genetic-iters", "0,x"], "--genetic-iters"),
    (["maxbatch", "--genetic-iters", "0,2.5"], "--genetic-iters"),
    (["maxbatch", "--time-limits", "fast"], "--time-limits"),
    (["maxbatch", "--time-limits", "1.2,0.9"], "--time-limits"),
    (["plan", "--max-time-ratio", "0.5"], "--max-time-ratio"),
    (["maxbatch", "--memory-budget", "0"], "--memory-budget"),
    (["plan", "--model", "torch.nn:Identity", "--input-shape", "3,a"], "--input-shape"),
    (["plan", "--model", "torch.nn:Identity", "--input-shape", "0"], "--input-shape"),
    (["plan", "--dtype", "float33"], "--dtype"),
    (["plan", "--batch", "-1"], "--batch"),
    (["plan", "--batch", "0"], "--batch"),
    (["plan", "--batch", "many"], "--batch"),
    (["plan", "--seq", "0"], "--seq"),
    (["profile", "--batch", "0"], "--batch"),
    (["plan", "--model", "tiny-resnet", "--seq", "8"], "no sequence length"),
    (["plan", "--model", "tiny-resnet", "--layers", "2"], "--layers"),
])
def test_bad_values_name_the_option(argv, message, capsys):
    assert main(argv) == 2
    one_error_line(capsys, message)


@pytest.mark.parametrize("factory,message", [
    ("raises", "calling the factory failed: RuntimeError: boom"),
    ("not_a_module", "returned a int, not an nn.Module"),
    ("needs_width", "no arguments"),
    ("missing", "cannot import model factory"),
])
def test_bad_user_factories_exit_2_with_one_line(factory, message, user_models, capsys):
    assert main(["plan", "--model", f"cli_test_models:{factory}", "--input-shape", "8"]) == 2
    one_error_line(capsys, f"cli_test_models:{factory}", message)


def test_user_model_factory(capsys):
    assert main(["plan", "--model", "torch.nn:Linear", "--input-shape", "8", "--batch", "4"]) == 2  # needs args
    assert main(["plan", "--model", "torch.nn:Identity", "--input-shape", "8", "--batch", "4"]) == 2
    assert "cannot be planned" in capsys.readouterr().err


@pytest.mark.slow
def test_user_model_imports_from_the_current_directory(user_models, capsys):
    assert main(["plan", *MLP, "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "cli_test_models:deep_mlp batch 4:" in out and "predicted peak" in out
    assert main(["plan", *MLP, "--batch", "4", "--memory-budget", "1KiB"]) == 2
    one_error_line(capsys, "smallest predicted peak")


def test_an_impossible_budget_exits_2_naming_the_minimum_before_any_table(user_models, capsys):
    assert main(["maxbatch", *MLP, "--memory-budget", "1KiB", "--genetic-iters", "0", "--no-baselines"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # no table of zeros
    error = out.err.strip()
    assert "\n" not in error and "Traceback" not in error
    assert "the budget (1.00 KiB) is below what a training step holds at batch 1 whatever the strategy: parameters " \
           "24.8 KiB, buffers 0 B, inputs 8.00 KiB, gradients 24.8 KiB = 57.5 KiB" in error
    assert error.endswith("raise the budget to at least 57.5 KiB")
    assert main(["plan", *MLP, "--batch", "4", "--memory-budget", "1KiB"]) == 2
    error = one_error_line(capsys, "the budget (1.00 KiB) is below what the step holds whatever the plan",
                           "= 81.5 KiB", "The smallest predicted peak found is")
    assert "search longer" not in error


def test_output_paths_are_checked_before_any_work(tmp_path, monkeypatch, capsys):
    import sublinear.tools.maxbatch

    def no_work(*args, **kwargs):
        raise AssertionError("the work ran before the output path was checked")

    monkeypatch.setattr(sublinear.tools.maxbatch, "compare", no_work)
    monkeypatch.setattr(sublinear.tools.maxbatch, "tune", no_work)
    missing = tmp_path / "no-such-dir" / "out.md"
    for argv in (["maxbatch", "--model", "tiny-resnet", "--out", str(missing)],
                 ["tune", "--model", "tiny-resnet", "--out", str(missing)],
                 ["tune", "--model", "tiny-resnet", "--plot", str(missing)],
                 ["plan", "--model", "tiny-resnet", "--plot", str(missing)]):
        assert main(argv) == 2
        one_error_line(capsys, f"cannot write {missing}: the directory {missing.parent} does not exist")
    assert main(["plan", "--model", "tiny-resnet", "--plot", str(tmp_path)]) == 2
    one_error_line(capsys, f"{tmp_path} is a directory")


def test_a_file_that_cannot_be_written_after_the_work_is_one_line_too(monkeypatch, capsys):
    import sublinear.tools.cli

    def disk_full(args):
        raise OSError(28, "No space left on device", "table.md")

    monkeypatch.setattr(sublinear.tools.cli, "_cmd_profile", disk_full)
    assert main(["profile", "--model", "tiny-resnet"]) == 2
    one_error_line(capsys, "sublinear profile: error: [Errno 28] No space left on device: 'table.md'")


def test_a_token_model_fed_floats_is_told_to_pass_dtype_int64(user_models, capsys):
    tokens = ["--model", "cli_test_models:tokens", "--seq", "8"]
    for command in ("plan", "maxbatch", "profile"):
        assert main([command, *tokens]) == 2
        one_error_line(capsys, "--model cli_test_models:tokens: the forward fails on zeros of shape [2, 8] float32",
                       "'indices'", "pass --dtype int64")
    assert main(["plan", *tokens, "--dtype", "int64", "--batch", "2"]) == 0
    assert "cli_test_models:tokens batch 2 seq 8:" in capsys.readouterr().out
    assert main(["plan", *MLP[:2], "--input-shape", "64,31"]) == 2  # another failing forward: what to check
    one_error_line(capsys, "the forward fails on zeros of shape [2, 64, 31] float32", "check --input-shape")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_maxbatch_on_cuda_without_cuda_exits_2(capsys):
    assert main(["maxbatch", "--model", "tiny-resnet", "--device", "cuda"]) == 2
    one_error_line(capsys, "--device cuda: no CUDA device is available")


def test_profile_takes_no_planner_options(capsys):
    for option in ("--seed", "--thresh-nr-try", "--workers", "--genetic-iters", "--memory-budget"):
        assert main(["profile", "--model", "tiny-gpt", option, "1"]) == 2
        one_error_line(capsys, "unrecognized arguments", option)


def test_help_lists_models_and_explains_every_option(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text
    for name in ("resnet50", "bert-base", "tiny-gpt", "hf:<ModelClass>", "pkg.module:fn"):
        assert name in text
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"maxbatch", "tune", "plan", "profile"}
    for name, command in commands.items():
        assert main([name, "--help"]) == 0
        assert "``" not in capsys.readouterr().out
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
        options = {o for a in command._actions if a.help != argparse.SUPPRESS for o in a.option_strings}
        assert ("--memory-budget" in options) == (name != "profile")
        assert "--budget" not in options  # a hidden alias on maxbatch and tune
    assert commands["maxbatch"].parse_args(["--budget", "2GiB"]).memory_budget == 2 * 2**30
    assert commands["tune"].parse_args(["--budget", "1GiB"]).memory_budget == 2**30


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sublinear {sublinear.__version__}"


@pytest.mark.slow
def test_plan_and_profile_end_to_end(capsys):
    assert main(["plan", "--model", "tiny-bert", "--batch", "8", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "block 0:" in out and "predicted peak" in out
    assert main(["profile", "--model", "tiny-gpt", "--batch", "2"]) == 0
    assert "per sample" in capsys.readouterr().out


@pytest.mark.slow
def test_plan_plots_the_step_memory(user_models, capsys):
    import matplotlib  # noqa: F401  (in the test extra)
    path = user_models / "step.png"
    assert main(["plan", *MLP, "--batch", "8", "--plot", str(path)]) == 0
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 500 and height > 200


def test_plots_without_matplotlib_fail_before_the_work(monkeypatch, tmp_path, capsys):
    import sublinear.tools.maxbatch

    def no_sweep(*args, **kwargs):
        raise AssertionError("the sweep ran before the missing matplotlib was noticed")

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(sublinear.tools.maxbatch, "tune", no_sweep)
    assert main(["tune", "--model", "tiny-resnet", "--plot", str(tmp_path / "c.png")]) == 2
    one_error_line(capsys, "--plot needs matplotlib")
    assert main(["plan", "--model", "tiny-resnet", "--plot", str(tmp_path / "s.png")]) == 2
    one_error_line(capsys, "--plot needs matplotlib")


@pytest.mark.slow
def test_hf_model_plans_on_meta(capsys):
    import transformers  # noqa: F401  (in the test extra)
    assert main(["plan", *TINY_HF, "--layers", "1", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "hf:BertForSequenceClassification" in out and "batch 2 seq 16" in out and "predicted peak" in out
    assert main(["plan", "--model", "hf:NoSuchModelClass"]) == 2
    one_error_line(capsys, "transformers has no model class 'NoSuchModelClass'")
    assert main(["plan", "--model", "hf:GPT2LMHeadModel", "--seq", "4096"]) == 2
    one_error_line(capsys, "seq must be in [1, 1024]")


@pytest.mark.slow
def test_maxbatch_skips_baselines_that_do_not_apply_and_writes_markdown(user_models, capsys):
    out = user_models / "table.md"
    argv = ["maxbatch", *MLP, "--memory-budget", "800KB", "--genetic-iters", "0", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    eager = next(line for line in printed if line.startswith("eager"))
    grid = next(line for line in printed if line.startswith("sublinear grid+mincut+optimal"))
    assert int(grid[56:].split()[0]) > int(eager[56:].split()[0])
    notes = [line for line in printed if line.startswith("note:")]
    assert len(notes) == 3 and "checkpoint every block skipped: no residual blocks" in notes[0]
    assert "HF gradient_checkpointing_enable skipped" in notes[2]
    text = out.read_text()
    assert f"`sublinear {' '.join(argv)}`" in text
    rows = [line.split(" | ")[1] for line in text.splitlines() if line.startswith("| cli_test_models:deep_mlp")]
    assert rows == ["eager", "sublinear grid+mincut+optimal+local, time <= 1.35"]
    assert text.count("Note: ") == 3
    assert not (user_models / "plan-cache").exists()  # planning time is reported: no plan from (or to) the cache


@pytest.mark.slow
def test_tune_sweeps_generations_of_a_small_model(user_models, capsys):
    out = user_models / "tune.md"
    assert main(["tune", *MLP, "--memory-budget", "800KB", "--genetic-iters", "0,1", "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| cli_test_models")]
    assert [int(r[1]) for r in rows] == [0, 1]
    assert float(rows[1][3].replace(",", "")) <= float(rows[0][3].replace(",", ""))  # never worse than the grid
    assert int(rows[1][6]) >= int(rows[0][6])


@pytest.mark.slow
def test_python_dash_m_version_imports_no_transformers():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "sublinear", "--version"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"sublinear {sublinear.__version__}"
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "sublinear.tools.cli" in imported and not any(name.startswith("transformers") for name in imported)


def test_hf_models_without_transformers_exit_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["plan", "--model", "hf:GPT2LMHeadModel"]) == 2
    one_error_line(capsys, "hf:GPT2LMHeadModel needs transformers (pip install 'sublinear[hf]')")


@pytest.mark.slow
def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "sublinear", "plan", "--model", "tiny-resnet", "--batch", "2"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "predicted peak" in result.stdout


@pytest.mark.slow
def test_console_script_imports_from_the_current_directory(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "sublinear")
    if not os.path.exists(script):
        pytest.skip("the sublinear console script is not installed beside this Python")
    (tmp_path / "cli_test_models.py").write_text(MLP_MODULE)
    result = subprocess.run([script, "plan", *MLP, "--batch", "4"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "predicted peak" in result.stdout, result.stderr


@pytest.mark.slow
def test_maxbatch_end_to_end(capsys):
    assert main(["maxbatch", "--model", "tiny-resnet", "--budget", "64MiB", "--genetic-iters", "0"]) == 0
    out = capsys.readouterr().out
    for row in ("eager", "checkpoint every block", "sublinear grid+mincut+optimal"):
        assert row in out
    sublinear_row = next(line for line in out.splitlines() if line.startswith("sublinear grid+mincut+optimal"))
    eager_row = next(line for line in out.splitlines() if line.startswith("eager"))
    assert int(sublinear_row[56:].split()[0]) > int(eager_row[56:].split()[0])


@pytest.mark.slow
def test_maxbatch_writes_markdown_with_its_command_and_plans_afresh(tmp_path, capsys):
    out = tmp_path / "table.md"
    argv = ["maxbatch", "--model", "tiny-resnet", "--budget", "64MiB", "--genetic-iters", "0",
            "--time-limits", "1.5", "--no-baselines", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert f"`sublinear {' '.join(argv)}`" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny-resnet")]
    assert [r.split(" | ")[1] for r in rows] == ["eager", "sublinear grid+mincut+optimal+local, time <= 1.35",
                                                 "sublinear grid+mincut+optimal+local, time <= 1.5"]
    capped, looser = rows[1].split(" | "), rows[2].split(" | ")
    assert int(capped[2]) > int(rows[0].split(" | ")[2]) and float(capped[4]) <= 1.35
    assert int(looser[2]) >= int(capped[2]) and float(looser[4]) <= 1.5
    assert not (tmp_path / "plan-cache").exists()  # planning time is reported: no plan from (or to) the cache


@pytest.mark.slow
def test_maxbatch_hf_model_end_to_end(capsys):
    import transformers  # noqa: F401  (in the test extra)
    assert main(["maxbatch", *TINY_HF, "--layers", "2", "--memory-budget", "24MiB", "--genetic-iters", "0"]) == 0
    out = capsys.readouterr().out
    rows = {line[:56].strip(): line[56:].split() for line in out.splitlines()
            if line.startswith(("eager", "checkpoint every", "HF gradient", "sublinear grid+mincut+optimal"))}
    grid = "sublinear grid+mincut+optimal+local, time <= 1.35"
    assert set(rows) == {"eager", "checkpoint every block", "HF gradient_checkpointing_enable", grid}
    assert int(rows["HF gradient_checkpointing_enable"][0]) > int(rows["eager"][0])
    assert int(rows[grid][0]) > int(rows["eager"][0]) and float(rows[grid][2]) <= 1.35
    assert "note: hf:BertForSequenceClassification layers=2 hidden=32: checkpoint_sequential sqrt(n) skipped" in out


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise(caplog):
    import io

    from sublinear.tools.cli import _Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    bar = _Progress(terminal)
    bar(0, 2, "first ...")
    bar(2, 2, "done")
    assert "\r" in terminal.getvalue() and "[" + "#" * _Progress.WIDTH + "] 2/2 done" in terminal.getvalue()
    with caplog.at_level("INFO", logger="sublinear.tools.cli"):
        _Progress(io.StringIO())(1, 2, "halfway")
    assert [r.getMessage() for r in caplog.records] == ["halfway"]
