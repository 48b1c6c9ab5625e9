# Start checkpoint run 24 (8 GiB, every peer 3 rounds, the goals' terms up to 7 in the time
# left) in its own session (call29.sh); call30.sh waits on it and collects. Library of
# 54fd44e (GPU tests passed there: 542 passed, 101 skipped); benchmark planner of 9540eae.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call61.sh $OUT/
NO_PREP=1 RUN_DIR=/tmp/run24 BUDGET_S=1560 WAIT_S=555 CKPT_ARGS="--gib 8 --repeats 3 --goal-repeats 7 --warmup-gib 0.5 --drop-caches" bash .devrun/call29.sh
