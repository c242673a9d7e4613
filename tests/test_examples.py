"""The examples run as a user would run them, and say what they promise."""
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name, *args):
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart():
    out = _run("quickstart.py")
    assert "6.weight   per-sample gradient (32, 10, 256)" in out
    assert "mean of per-sample == param.grad: True" in out


def test_check_my_model():
    out = _run("check_my_model.py")
    assert "OK at rtol=1e-10" in out


def test_gradient_noise_scale():
    out = _run("gradient_noise_scale.py", "--steps", "20")
    assert "gradient noise scale B_simple" in out


def test_laplace_digits(tmp_path):
    out = _run("laplace_digits.py", "--epochs", "10", "--out", str(tmp_path / "reliability.png"))
    assert "Laplace (kron, gradhooks)" in out and "ECE" in out
    assert (tmp_path / "reliability.png").stat().st_size > 0


def test_dp_lora_finetune(tmp_path):
    out = _run("dp_lora_finetune.py", "--steps", "4", "--pretrain-steps", "2",
               "--out", str(tmp_path / "curves.png"))
    assert "LoRA, DP-SGD (book-keeping" in out and "epsilon = " in out
    assert (tmp_path / "curves.png").stat().st_size > 0
