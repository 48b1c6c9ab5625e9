# Start checkpoint run 20 (8 GiB, every peer, 3 rounds) on library fb794e1 (its GPU tests
# ran in call 45) in its own session (call29.sh); call30.sh waits on it and collects.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call48.sh $OUT/
NO_PREP=1 RUN_DIR=/tmp/run20 BUDGET_S=1380 WAIT_S=565 CKPT_ARGS="--gib 8 --repeats 3 --warmup-gib 0.5 --drop-caches" bash .devrun/call29.sh
