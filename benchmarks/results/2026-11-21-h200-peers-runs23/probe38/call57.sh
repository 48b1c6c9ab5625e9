# Probe 38: save phases with the front door's saves beside the ceiling's (see .devrun/probe38.py).
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call57.sh .devrun/probe38.py $OUT/
df -h /tmp > $OUT/df.txt; cat /proc/mounts | grep " / " >> $OUT/df.txt
timeout 540 python3 .devrun/probe38.py $OUT/probe38.json 8 520 > $OUT/probe38.log 2>&1; echo "rc $?"
tail -20 $OUT/probe38.log
