# GPU tests on this library; if they pass, start checkpoint run 21 (8 GiB, every peer, 3
# rounds) in its own session (call29.sh); call30.sh waits on it and collects.
. .devrun/prep.sh
s0=$(date +%s)
cp .devrun/commit.txt .devrun/call50.sh $OUT/
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; rc=$?
tail -3 $OUT/gpu-tests.txt; grep FAILED $OUT/gpu-tests.txt | head
echo "tests took $(( $(date +%s) - s0 )) s, rc $rc"
[ $rc -eq 0 ] || { echo "GPU tests failed: run 21 not started"; exit 1; }
NO_PREP=1 RUN_DIR=/tmp/run21 BUDGET_S=1380 WAIT_S=$(( 560 - ($(date +%s) - s0) )) CKPT_ARGS="--gib 8 --repeats 3 --warmup-gib 0.5 --drop-caches" bash .devrun/call29.sh
