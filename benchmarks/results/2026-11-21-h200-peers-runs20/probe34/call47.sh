# Probe 34: finer marks inside the save.
. .devrun/prep.sh
cp .devrun/commit.txt .devrun/call47.sh .devrun/probe34.py $OUT/
timeout 200 python3 .devrun/probe34.py $OUT/probe34.json 8 2 vda > $OUT/probe34.log 2>&1; echo "rc $?"
tail -30 $OUT/probe34.log | cut -c1-1500
