"""Packaging for the clean-room `deepspeed` distribution."""

import pathlib
import re

import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


HERE = pathlib.Path(__file__).parent


def read_version() -> str:
    text = (HERE / "deepspeed" / "version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    if match is None:
        raise RuntimeError("deepspeed/version.py does not define __version__")
    return match.group(1)


def read_requirements(name: str) -> list:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


class BuildPyWithSources(build_py):
    """Ship the native sources (`csrc/`) inside the package so a wheel can JIT-build its ops."""

    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "deepspeed" / "csrc"
        if (HERE / "csrc").is_dir():
            shutil.copytree(HERE / "csrc", target, dirs_exist_ok=True)


setup(
    name="deepspeed",
    cmdclass={"build_py": BuildPyWithSources},
    version=read_version(),
    description="A clean-room implementation of DeepSpeed ZeRO-3 with start()/stop() context managers",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed", "deepspeed.*"]),
    python_requires=">=3.9",
    install_requires=read_requirements("requirements.txt"),
    entry_points={
        "console_scripts": [
            "deepspeed=deepspeed.launcher.runner:main",
            "ds=deepspeed.launcher.runner:main",  # upstream's short name for the same command
            "ds_report=deepspeed.env_report:main",
            "zero_to_fp32=deepspeed.utils.zero_to_fp32:main",
        ]
    },
    license="Apache-2.0",
)
