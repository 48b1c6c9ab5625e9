# sourced: install the carried wheels, set the environment
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ${EXTRA_WHEELS:-} >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 ARRAYIO_CACHE_DIR=/tmp/aio-cache XLA_PYTHON_CLIENT_PREALLOCATE=false
