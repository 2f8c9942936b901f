"""The built wheel, installed into a new virtual environment, as a `pip install trl_ext` user gets it: the `trl-ext`
command, the recipes inside the package, the accelerate configurations as package data and the project URLs.

The new venv holds only the wheel (`--no-deps`); the dependencies (torch, TRL, ...) are taken from this environment
through a path file, so nothing is downloaded. The repository is kept off the path: whatever runs comes from the
wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from online_helpers import EXAMPLES, REPO, subprocess_env


def _run(cmd, cwd, env, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(venv folder, environment)`` with the freshly built wheel installed and the repository off the path."""
    root = tmp_path_factory.mktemp("wheel")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # pip must not see the checkout as installed
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(root),
        str(REPO),
    ]
    _run(build, root, clean)
    (wheel,) = root.glob("trl_ext-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, clean)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], root, clean)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    # the dependencies of this environment, after the venv's own packages (so trl_ext resolves to the wheel's copy)
    Path(site, "_deps_of_the_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = subprocess_env()
    env["PYTHONPATH"] = ""
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return venv, env, wheel


def test_wheel_holds_the_command_the_recipes_and_the_configs(installed):
    _, _, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "trl_ext/commands.py" in names and "trl_ext/recipes/ppo.py" in names
    assert "trl_ext/accelerate_configs/deepspeed_zero2.yaml" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Project-URL: Repository, https://github.com/trl-ext/trl_ext" in text
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "trl-ext = trl_ext.commands:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_command_helps_and_trains(installed, tiny_workdir):
    venv, env, _ = installed
    where = _run([str(venv / "bin" / "python"), "-c", "import trl_ext; print(trl_ext.__file__)"], tiny_workdir, env)
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel's copy, not the checkout
    usage = _run(["trl-ext", "--help"], tiny_workdir, env).stdout
    assert "repulse" in usage and "deepspeed_zero2" in usage
    helped = _run(["trl-ext", "ppo", "--help"], tiny_workdir, env).stdout
    assert helped.startswith("usage: trl-ext ppo ")
    for option in ("--model_name_or_path", "--reward_model_path", "--num_ppo_epochs", "--config"):
        assert option in helped
    # the documented tiny run, with the YAML from the repository's examples (the inputs are in tiny_workdir)
    out = tiny_workdir / "outputs" / "wheel-ppo"
    proc = _run(["trl-ext", "ppo", "--config", str(EXAMPLES / "ppo_tiny.yaml"), "--total_episodes", "32",
                 "--output_dir", str(out)], tiny_workdir, env)  # fmt: skip
    assert "Trained 2 PPO updates" in proc.stdout + proc.stderr
    assert (out / "config.json").is_file() and (out / "value_model" / "config.json").is_file()
    # and through accelerate launch, with a configuration that ships in the package
    out = tiny_workdir / "outputs" / "wheel-ppo-launch"
    proc = _run(["trl-ext", "ppo", "--accelerate_config", "single_gpu", "--mixed_precision", "no", "--config",
                 str(EXAMPLES / "ppo_tiny.yaml"), "--total_episodes", "16", "--output_dir", str(out)], tiny_workdir,
                env)  # fmt: skip
    assert "Trained 1 PPO updates" in proc.stdout + proc.stderr and (out / "config.json").is_file()


def test_unknown_command_and_config_are_clear_errors(installed, tmp_path):
    _, env, _ = installed
    proc = subprocess.run(["trl-ext", "ppox"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown command 'ppox'" in proc.stderr and "repulse" in proc.stderr
    proc = subprocess.run(["trl-ext", "ppo", "--accelerate_config", "nope"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "no accelerate config 'nope'" in proc.stderr and "fsdp2" in proc.stderr


def test_import_without_torch_gives_one_install_hint(tmp_path):
    """A Python where `torch` cannot be imported: `import trl_ext` fails with one line that says what to install."""
    blocker = tmp_path / "torch.py"
    blocker.write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", "import trl_ext"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: trl_ext needs PyTorch") and "pip install torch" in last
    assert "During handling" not in proc.stderr  # one error, not a chain
