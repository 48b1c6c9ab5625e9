# Start checkpoint run 23 (8 GiB, every peer 3 rounds, the targets' terms 7) in its own
# session (call29.sh); call30.sh waits on it and collects. The library is that of 54fd44e
# (GPU tests passed there: 542 passed, 101 skipped), run 22's was bf978ea.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call60.sh $OUT/
NO_PREP=1 RUN_DIR=/tmp/run23 BUDGET_S=1560 WAIT_S=555 CKPT_ARGS="--gib 8 --repeats 3 --goal-repeats 7 --warmup-gib 0.5 --drop-caches" bash .devrun/call29.sh
