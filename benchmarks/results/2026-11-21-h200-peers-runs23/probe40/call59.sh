# Probe 40: pinned staging buffers on huge pages (see .devrun/probe40.py).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call59.sh .devrun/probe40.py $OUT/
df -h /tmp > $OUT/df.txt; cat /proc/mounts | grep " / " >> $OUT/df.txt
timeout 540 python3 .devrun/probe40.py $OUT/probe40.json 8 520 > $OUT/probe40.log 2>&1; echo "rc $?"
tail -20 $OUT/probe40.log
