# GPU tests on the library of the commit named in commit.txt; if they pass, start checkpoint
# run 25 (8 GiB, every peer 3 rounds, the goals' terms up to 7 in the time left) in its own
# session (call29.sh); call30.sh waits on it and collects.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call64.sh $OUT/
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/gpu-tests.txt 2>&1; rc=$?
echo "tests rc $rc"; tail -1 $OUT/gpu-tests.txt; grep FAILED $OUT/gpu-tests.txt | head
[ $rc = 0 ] || exit 1
NO_PREP=1 RUN_DIR=/tmp/run25 BUDGET_S=1480 WAIT_S=480 CKPT_ARGS="--gib 8 --repeats 3 --goal-repeats 7 --warmup-gib 0.5 --drop-caches" bash .devrun/call29.sh
