import subprocess
import sys

import pytest

from sublinear.cli import main


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert main(["maxbatch", "--budget", "lots"]) == 2
    assert main(["plan", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err


def test_maxbatch_end_to_end(capsys):
    assert main(["maxbatch", "--model", "tiny-resnet", "--budget", "64MiB", "--genetic-iters", "0"]) == 0
    out = capsys.readouterr().out
    for row in ("eager", "checkpoint every block", "sublinear grid"):
        assert row in out
    sublinear_row = next(line for line in out.splitlines() if line.startswith("sublinear grid"))
    eager_row = next(line for line in out.splitlines() if line.startswith("eager"))
    assert int(sublinear_row.split()[2]) > int(eager_row.split()[1])


def test_plan_and_profile_end_to_end(capsys):
    assert main(["plan", "--model", "tiny-bert", "--batch", "8", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "block 0:" in out and "predicted peak" in out
    assert main(["profile", "--model", "tiny-gpt", "--batch", "2"]) == 0
    assert "per sample" in capsys.readouterr().out


def test_user_model_factory(capsys):
    assert main(["plan", "--model", "torch.nn:Linear", "--input-shape", "8", "--batch", "4"]) == 2  # needs args
    assert main(["plan", "--model", "torch.nn:Identity", "--input-shape", "8", "--batch", "4"]) == 2
    assert "cannot be planned" in capsys.readouterr().err


def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "sublinear", "plan", "--model", "tiny-resnet", "--batch", "2"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "predicted peak" in result.stdout


@pytest.mark.parametrize("argv,message", [
    (["maxbatch", "--genetic-iters", "0,x"], "--genetic-iters"),
    (["maxbatch", "--genetic-iters", "0,2.5"], "--genetic-iters"),
    (["maxbatch", "--flops-limits", "fast"], "--flops-limits"),
    (["plan", "--model", "torch.nn:Identity", "--input-shape", "3,a"], "--input-shape"),
    (["plan", "--dtype", "float33"], "--dtype"),
    (["plan", "--model", "tiny-resnet", "--batch", "4", "--memory-budget", "1KiB"], "smallest predicted peak"),
])
def test_bad_values_name_the_option(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_maxbatch_writes_markdown_with_its_command_and_plans_afresh(tmp_path, capsys):
    out = tmp_path / "table.md"
    argv = ["maxbatch", "--model", "tiny-resnet", "--budget", "64MiB", "--genetic-iters", "0",
            "--flops-limits", "1.3", "--no-baselines", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert f"`sublinear {' '.join(argv)}`" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny-resnet")]
    assert [r.split(" | ")[1] for r in rows] == ["eager", "sublinear grid", "sublinear budget, FLOPs <= 1.3"]
    budget_row = rows[-1].split(" | ")
    assert int(budget_row[2]) > int(rows[0].split(" | ")[2]) and float(budget_row[4]) <= 1.3
    assert not (tmp_path / "plan-cache").exists()  # planning time is reported: no plan from (or to) the cache


def test_tune_sweeps_generations(tmp_path, capsys):
    out = tmp_path / "tune.md"
    assert main(["tune", "--model", "tiny-resnet", "--budget", "64MiB", "--genetic-iters", "0,2",
                 "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| tiny-resnet")]
    assert [int(r[1]) for r in rows] == [0, 2]
    assert float(rows[1][3].replace(",", "")) <= float(rows[0][3].replace(",", ""))  # never worse than the grid
    assert int(rows[1][6]) >= int(rows[0][6])


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise(caplog):
    import io

    from sublinear.cli import _Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    bar = _Progress(terminal)
    bar(0, 2, "first ...")
    bar(2, 2, "done")
    assert "\r" in terminal.getvalue() and "[" + "#" * _Progress.WIDTH + "] 2/2 done" in terminal.getvalue()
    with caplog.at_level("INFO", logger="sublinear.cli"):
        _Progress(io.StringIO())(1, 2, "halfway")
    assert [r.getMessage() for r in caplog.records] == ["halfway"]
