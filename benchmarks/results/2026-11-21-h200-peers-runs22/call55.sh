# Start checkpoint run 22 (8 GiB, every peer 3 rounds, the targets' terms 5) in its own
# session (call29.sh); call30.sh waits on it and collects. The library is that of bf978ea
# (GPU tests passed there); only the benchmark changed since.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call55.sh $OUT/
NO_PREP=1 RUN_DIR=/tmp/run22 BUDGET_S=1560 WAIT_S=555 CKPT_ARGS="--gib 8 --repeats 3 --goal-repeats 5 --warmup-gib 0.5 --drop-caches" bash .devrun/call29.sh
