# Probe 39: a save without its reservation beside one with it (see .devrun/probe39.py).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call58.sh .devrun/probe39.py $OUT/
df -h /tmp > $OUT/df.txt; cat /proc/mounts | grep " / " >> $OUT/df.txt
timeout 540 python3 .devrun/probe39.py $OUT/probe39.json 8 520 > $OUT/probe39.log 2>&1; echo "rc $?"
tail -20 $OUT/probe39.log
