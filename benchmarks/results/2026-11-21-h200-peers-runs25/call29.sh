# Start checkpoint run 16 (8 GiB, every peer, 3 rounds) in its own session, so that it
# outlives this call; wait for it up to this call's limit. call30.sh waits on and collects.
[ -n "$NO_PREP" ] || . .devrun/prep.sh
start=$(date +%s)
R=${RUN_DIR:-/tmp/run16}
ARGS=${CKPT_ARGS:---gib 8 --repeats 3 --warmup-gib 1 --drop-caches}
rm -rf $R /tmp/aio-cache; mkdir -p $R/repo
cp -r arrayio benchmarks $R/repo/
cp .devrun/commit.txt $R/commit.txt
cp .devrun/call29.sh .devrun/call30.sh $R/
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no GPU") > $R/machine.txt
echo "call 1 start $start" > $R/boundaries.txt
cmd="python3 -m benchmarks.peers.checkpoint $ARGS --out $R/ckpt --deadline $(( start + ${BUDGET_S:-1450} ))"
echo "$cmd" > $R/command.txt
cd $R/repo
PYTHONPATH=/tmp/site setsid nohup bash -c "$cmd 2>&1 | while IFS= read -r l; do printf '%s %s\n' \"\$(date +%s)\" \"\$l\"; done > $R/run.log; echo \${PIPESTATUS[0]} > $R/rc" </dev/null >/dev/null 2>&1 &
cd - >/dev/null
while [ ! -e $R/rc ] && [ $(( $(date +%s) - start )) -lt ${WAIT_S:-575} ]; do sleep 5; done
echo "call 1 end $(date +%s)" >> $R/boundaries.txt
tail -25 $R/run.log
cp -r $R/ckpt $R/run.log $R/boundaries.txt $OUT/ 2>/dev/null
echo "rc: $(cat $R/rc 2>/dev/null || echo running) at +$(( $(date +%s) - start )) s"
