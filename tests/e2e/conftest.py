import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def deepserve():
    exe = pathlib.Path(os.environ.get("DEEPSERVE_BIN", ROOT / "build" / "deepserve"))
    if not exe.exists():
        pytest.fail(f"{exe} is not built (run scripts/setup.sh)")
    return exe


@pytest.fixture(scope="session")
def run(deepserve):
    def _run(*args, input=None, timeout=300, check=True, env=None, cwd=None):
        p = subprocess.run([str(deepserve), *map(str, args)], input=input, capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=cwd)
        if check and p.returncode != 0:
            raise AssertionError(f"deepserve {' '.join(map(str, args))} failed ({p.returncode}):\n"
                                 f"{p.stdout}\n{p.stderr}")
        return p
    return _run
