"""Check a built sdist and wheel: ``python .ci/check_dist.py DIST_DIR``.

The sdist carries LICENSE; the wheel, installed alone into a fresh venv (uv if it is on PATH,
else venv + pip), imports every module of ``shardlib`` and ``jax_extra`` from site-packages
(not from the checkout), ships ``py.typed`` and LICENSE.
"""

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CHECK = r"""
import importlib
import importlib.metadata as md
import pkgutil
import sys
from pathlib import Path

for top in ("shardlib", "jax_extra"):
    pkg = importlib.import_module(top)
    where = Path(pkg.__file__).parent
    assert "site-packages" in where.parts, f"{top} imported from {where}, not the installed wheel"
    assert (where / "py.typed").is_file(), f"{top}: py.typed is missing from {where}"
    for mod in pkgutil.walk_packages(pkg.__path__, top + "."):
        importlib.import_module(mod.name)
files = [str(f) for f in md.files("shardlib") or []]
assert any(f.endswith("LICENSE") for f in files), f"the wheel has no LICENSE: {files}"
import shardlib
print("wheel OK: shardlib", shardlib.__version__, "| python", sys.version.split()[0])
"""


def main(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    print("built:", sdist.name, wheel.name)
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    if not any(n.count("/") == 1 and n.endswith("/LICENSE") for n in names):
        sys.exit("the sdist has no LICENSE file")
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        python = venv / "bin" / "python"
        if shutil.which("uv"):
            subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(venv)], check=True)
            subprocess.run(
                ["uv", "pip", "install", "-q", "-p", str(python), str(wheel)], check=True
            )
        else:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True)
        # From the temporary folder: nothing may come from the source tree.
        subprocess.run([str(python), "-c", CHECK], cwd=tmp, check=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
