# Wait for the run call29.sh started, then bring back everything it wrote.
start=$(date +%s)
R=${RUN_DIR:-/tmp/run16}
echo "call start $start" >> $R/boundaries.txt
while [ ! -e $R/rc ] && [ $(( $(date +%s) - start )) -lt ${WAIT_S:-580} ]; do sleep 5; done
echo "call end $(date +%s)" >> $R/boundaries.txt
tail -45 $R/run.log
cp -r $R/ckpt $R/run.log $R/boundaries.txt $R/command.txt $R/machine.txt $R/commit.txt $R/call29.sh $R/call30.sh $OUT/ 2>/dev/null
echo "rc: $(cat $R/rc 2>/dev/null || echo running) at +$(( $(date +%s) - start )) s"
