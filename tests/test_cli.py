import subprocess
import sys

import pytest

from sublinear.cli import main, parse_size


@pytest.mark.parametrize("text,expected", [("11GiB", 11 * 2**30), ("500MB", 500 * 10**6), ("1.5 KiB", 1536),
                                           ("4096", 4096), ("2gb", 2 * 10**9)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "11XB", "-3GiB", "GiB", "0"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


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
    assert "block   0" in out and "predicted peak" in out
    assert main(["profile", "--model", "tiny-gpt", "--batch", "2"]) == 0
    assert "per sample" in capsys.readouterr().out


def test_user_model_factory(capsys):
    assert main(["plan", "--model", "torch.nn:Identity", "--input-shape", "8", "--batch", "4"]) == 0
    assert "0 blocks over 0 ops" in capsys.readouterr().out


def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "sublinear", "plan", "--model", "tiny-resnet", "--batch", "2"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "predicted peak" in result.stdout
