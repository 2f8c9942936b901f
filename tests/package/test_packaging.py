"""The package as users get it: a wheel and an sdist build, and the wheel runs the tiny PPO example in a fresh venv."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TINY_PPO = """
import os, sys
import trl_ext
assert os.path.realpath(trl_ext.__file__).startswith(os.path.realpath(sys.prefix)), trl_ext.__file__
from trl_ext import PPOConfig, PPOTrainer
from trl_ext import testing as kit

tokenizer = kit.build_tokenizer()
policy = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
reward = kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer)
critic = kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer)
args = PPOConfig(output_dir="out", per_device_train_batch_size=4, total_episodes=8, num_ppo_epochs=1,
                 response_length=4, report_to="none", save_strategy="no", bf16=False, use_cpu=True,
                 activation_checkpointing=False, num_sample_generations=0)
trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                     value_model=critic, train_dataset=kit.prompt_dataset(n=8))
trainer.train()
print("TINY-PPO-OK", trl_ext.__version__, trainer.state.global_step)
"""


def _build(kind: str, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", f"--{kind}", "--outdir", str(out), str(REPO)],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    (path,) = out.glob("*.whl" if kind == "wheel" else "*.tar.gz")
    return path


@pytest.mark.slow
def test_sdist_and_wheel_contents(tmp_path):
    pytest.importorskip("build")
    wheel, sdist = _build("wheel", tmp_path / "w"), _build("sdist", tmp_path / "s")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith("licenses/LICENSE") for n in names) and "trl_ext/__init__.py" in names
    assert not any(n.startswith(("tests/", "recipes/")) for n in names)
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    for needed in ("LICENSE", "CHANGELOG.md", "CITATION.cff", "recipes/ppo.py", "examples/ppo_tiny.yaml", "tests"):
        assert needed in members, needed
    assert not any(m.startswith("results/") for m in members)


@pytest.mark.slow
def test_wheel_runs_the_tiny_ppo_example_in_a_fresh_venv(tmp_path):
    """The wheel installed (without dependencies) into a new venv whose dependencies come from this environment by a
    path entry (so no download); trl_ext must be imported from the new venv, not from the checkout."""
    pytest.importorskip("build")
    wheel = _build("wheel", tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    Path(site, "deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)  # fmt: skip
    (tmp_path / "run").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-c", TINY_PPO], cwd=tmp_path / "run", env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TINY-PPO-OK" in result.stdout
